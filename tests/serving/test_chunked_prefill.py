"""Chunked prefill over gRPC: prompt chunks riding in Verify calls on a real verifier process give
the in-process verifier's first token and features, and a verifier restarted between two chunks
is restored from the chunks read so far (RemoteVerifier keeps them), with the same result."""

from __future__ import annotations

import pytest
import torch

from dspark.loading import load_target
from dspark.sampling import SamplingParams
from dspark.serving.remote_verifier import RemoteVerifier, VerifierRejected
from loadtest.tiny_models import LAYER_IDS
from dspark.verifier import PrefillChunk, TargetVerifier, VerifyRequest

PROMPT = [3, 9, 27, 17, 5, 6, 40]
GREEDY = SamplingParams(temperature=0)


def chunks_of(rid: str, pieces: list[list[int]], done: int) -> list[PrefillChunk]:
    """The chunk after the first `done` pieces, as the engine plans it."""
    piece = pieces[done]
    return [PrefillChunk(rid, piece, done == len(pieces) - 1, GREEDY, continued=done > 0)]


@pytest.fixture(scope="module")
def local(tiny_models):
    return TargetVerifier(load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024))


def test_chunks_over_grpc_equal_one_local_prefill(shared_verifier, local):
    whole = local.prefill(["whole"], [PROMPT], [GREEDY], [None])
    remote = RemoteVerifier(shared_verifier.address)
    pieces = [PROMPT[:3], PROMPT[3:6], PROMPT[6:]]
    try:
        features, first = [], None
        for done in range(len(pieces)):
            out = remote.verify([], chunks_of("grpc-chunked", pieces, done))
            assert out.prefill_tokens == len(pieces[done]) and out.batch_tokens == 0
            features.append(out.prefill.features[0])
            first = out.prefill.first_tokens[0]
            assert (first is None) == (done < len(pieces) - 1)
        assert first == whole.first_tokens[0]
        torch.testing.assert_close(torch.cat(features), whole.features[0], atol=1e-4, rtol=1e-4)
        # the next round verifies it like any request
        step = remote.verify([VerifyRequest("grpc-chunked", first, None, 0, GREEDY)])
        local_step = local.verify([VerifyRequest("whole", first, None, 0, GREEDY)])
        assert step.output_tokens == local_step.output_tokens
        with pytest.raises(VerifierRejected, match="vocabulary"):
            remote.verify([], [PrefillChunk("bad", [10 ** 6], True, GREEDY)])
    finally:
        remote.release("grpc-chunked")
        local.release("whole")
        remote.close()


def test_verifier_restarted_between_chunks_is_restored(launcher, local):
    whole = local.prefill(["whole2"], [PROMPT], [GREEDY], [None])
    local.release("whole2")
    pieces = [PROMPT[:4], PROMPT[4:]]
    with launcher.restartable_verifier("verifier_chunk_restart") as (remote, crash_and_restart):
        assert remote.verify([], chunks_of("r", pieces, 0)).prefill.first_tokens == [None]
        crash_and_restart()
        out = remote.verify([], chunks_of("r", pieces, 1))  # NOT_FOUND -> restore 4 -> retry
        assert out.prefill.first_tokens == whole.first_tokens


def test_a_recomputed_request_is_restored_with_its_anchor(launcher, local):
    """A preempted request (dspark.engine) is recomputed as chunks that sample nothing, then
    verified from its anchor, which no chunk read: a verifier restarted after that must be
    restored with the anchor in place, so the next steps give the local tokens and features
    (the tiny target repeats its last token, so the features are what tells a lost token)."""
    greedy = [local.prefill(["ref"], [PROMPT], [GREEDY], [None]).first_tokens[0]]
    features = []
    for _ in range(6):
        step = local.verify([VerifyRequest("ref", greedy[-1], None, 0, GREEDY)])
        greedy += step.output_tokens[0]
        features.append(step.features[0])
    local.release("ref")
    with launcher.restartable_verifier("verifier_recompute_restart") as (remote, crash_and_restart):
        # two outputs so far: the first is re-read, the second is the anchor
        recompute = PrefillChunk("rc", PROMPT + greedy[:1], False, GREEDY)
        assert remote.verify([], [recompute]).prefill.first_tokens == [None]
        for i in range(1, 6):
            if i == 3:  # restarted: the next call restores
                crash_and_restart()
            step = remote.verify([VerifyRequest("rc", greedy[i], None, 0, GREEDY)])
            assert step.output_tokens == [greedy[i + 1:i + 2]], i
            torch.testing.assert_close(step.features[0], features[i], atol=1e-4, rtol=1e-4)
