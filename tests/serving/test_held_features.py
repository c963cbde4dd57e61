"""Held features over gRPC (dspark.feature_stash): a real verifier process keeps the features of
items sent with hold_features and hands them back in order with TakeFeatures, equal to what the
in-process verifier returns at once; a verifier restarted while holding them is restored with
`held_from` and holds the restored tokens' features again; a bad held_from is refused."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark.loading import load_target
from dspark.sampling import SamplingParams
from dspark.serving.protos import pb, rpc
from dspark.serving.remote_verifier import RemoteVerifier
from loadtest.tiny_models import LAYER_IDS
from dspark.verifier import PrefillChunk, TargetVerifier, VerifyRequest

PROMPT = [3, 9, 27, 17, 5, 6, 40]
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def local(tiny_models):
    return TargetVerifier(load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024))


def run_rounds(verifier, rid: str, hold: bool, decode_rounds: int):
    """A prompt read in two chunks, then plain decoding steps; every item says `hold`. Returns
    the returned features in order (None where held) and the committed tokens."""
    returned, tokens = [], list(PROMPT)
    out = verifier.verify([], [PrefillChunk(rid, PROMPT[:4], False, GREEDY, hold_features=hold)])
    returned.append(out.prefill.features[0])
    out = verifier.verify([], [PrefillChunk(rid, PROMPT[4:], True, GREEDY, continued=True,
                                            hold_features=hold)])
    returned.append(out.prefill.features[0])
    anchor = out.prefill.first_tokens[0]
    for _ in range(decode_rounds):
        step = verifier.verify([VerifyRequest(rid, anchor, None, 0, GREEDY, hold_features=hold)])
        returned.append(step.features[0])
        tokens.append(anchor)
        anchor = step.output_tokens[0][-1]
    return returned, tokens, anchor


def test_held_features_come_back_in_order_equal_to_returned_ones(shared_verifier, local):
    direct, tokens, _ = run_rounds(local, "direct", hold=False, decode_rounds=3)
    remote = RemoteVerifier(shared_verifier.address)
    try:
        returned, held_tokens, anchor = run_rounds(remote, "held", hold=True, decode_rounds=3)
        assert held_tokens == tokens and all(f is None for f in returned)
        [[piece]] = remote.take_features(["held"])
        torch.testing.assert_close(piece.features, torch.cat(direct), atol=1e-4, rtol=1e-4)
        assert piece.positions.tolist() == list(range(len(tokens)))
        assert piece.token_ids.tolist() == tokens
        assert remote.take_features(["held"]) == [[]]  # taken: nothing is held any more
        # after a take, a round that does not hold gets its features back at once
        step = remote.verify([VerifyRequest("held", anchor, None, 0, GREEDY)])
        assert step.features[0] is not None and step.features[0].shape[0] == 1
    finally:
        remote.release("held")
        local.release("direct")
        remote.close()


def test_held_features_survive_a_verifier_restart(launcher, local):
    direct, tokens, _ = run_rounds(local, "direct2", hold=False, decode_rounds=2)
    local.release("direct2")
    with launcher.restartable_verifier("verifier_held_restart") as (remote, crash_and_restart):
        out = remote.verify([], [PrefillChunk("r", PROMPT, True, GREEDY)])  # features returned
        anchor = out.prefill.first_tokens[0]
        held = remote.verify([VerifyRequest("r", anchor, None, 0, GREEDY, hold_features=True)])
        assert held.features == [None]
        anchor = held.output_tokens[0][-1]
        crash_and_restart()
        # NOT_FOUND -> restore (holding from the prompt's end) -> retry, held too
        step = remote.verify([VerifyRequest("r", anchor, None, 0, GREEDY, hold_features=True)])
        assert step.features == [None]
        [[piece]] = remote.take_features(["r"])
        n = len(PROMPT)
        assert piece.positions.tolist() == [n, n + 1]
        assert piece.token_ids.tolist() == tokens[n:]
        torch.testing.assert_close(piece.features, torch.cat(direct)[n:], atol=1e-4, rtol=1e-4)


def test_held_from_outside_a_restore_is_refused(shared_verifier):
    with grpc.insecure_channel(shared_verifier.address) as ch:
        stub = rpc.verifier.VerifierStub(ch)
        item = pb.verifier.PrefillItem(request_id="bad-held", prompt_ids=PROMPT, held_from=2)
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(pb.verifier.PrefillRequest(items=[item]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "held_from" in e.value.details()
        item = pb.verifier.PrefillItem(request_id="bad-held", prompt_ids=PROMPT, held_from=99)
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(pb.verifier.PrefillRequest(items=[item], restore=True), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            stub.TakeFeatures(pb.verifier.TakeFeaturesRequest(request_ids=["never-seen"]),
                              timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
