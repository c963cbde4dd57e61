"""RemoteDrafter against a real drafter service process: blocks equal the in-process drafter's,
whole or cut to the first positions (`num_positions`, the scheduler's capacity), and a bad
position count is refused as INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark.loading import load_method_drafter, load_target
from dspark.models.draft_types import DraftRequest
from dspark.sampling import SamplingParams
from dspark.serving.grpc_runtime import channel
from dspark.serving.local_stack import wait_grpc
from dspark.serving.protos import pb, rpc
from dspark.serving.remote_drafter import RemoteDrafter
from loadtest.tiny_models import LAYER_IDS


@pytest.fixture(scope="module")
def drafter_service(launcher):
    proc, address = launcher.drafter("drafter_positions")
    wait_grpc(proc, address)
    yield address
    proc.stop()


def test_first_positions_match_the_in_process_drafter(drafter_service, tiny_models):
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024)
    local = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    remote = RemoteDrafter(drafter_service)
    try:
        gamma = remote.gamma
        assert gamma == local.gamma
        g = torch.Generator().manual_seed(0)
        features = torch.randn(9, local.fc.in_features, generator=g)
        tokens = torch.randint(4, 60, (9,), generator=g)
        for d in (local, remote):
            d.append_context("r", features, torch.arange(9), tokens)
        request = [DraftRequest("r", 11, 9, SamplingParams(temperature=0))]
        whole = local.draft(request)[0]
        for n in (None, 1, 2):
            got = remote.draft(request, num_positions=n)[0]
            expected_len = gamma if n is None else n
            assert got.gamma == expected_len
            assert torch.equal(got.tokens, whole.tokens[:expected_len])
            assert torch.allclose(got.confidences, whole.confidences[:expected_len], atol=1e-5)
        with pytest.raises(ValueError, match="num_positions"):
            remote.draft(request, num_positions=gamma + 1)
    finally:
        remote.close()


def test_drafts_are_processed_in_the_service_as_in_process(drafter_service, tiny_models):
    """logit_bias and min_tokens (with the output count, DraftItem.num_output) reach the
    drafter service: its blocks equal the in-process drafter's, and they differ from the
    unprocessed ones (the bias bans the raw first draft, min_tokens the raw second)."""
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024)
    local = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    remote = RemoteDrafter(drafter_service)
    try:
        g = torch.Generator().manual_seed(2)
        features = torch.randn(9, local.fc.in_features, generator=g)
        tokens = torch.randint(4, 60, (9,), generator=g)
        for d in (local, remote):
            d.append_context("p", features, torch.arange(9), tokens)
        raw = local.draft([DraftRequest("p", 11, 9, SamplingParams(temperature=0))])[0].tokens
        params = SamplingParams(temperature=0, logit_bias={int(raw[0]): -100.0}, min_tokens=5,
                                stop_token_ids=(int(raw[1]),))
        for num_output in (3, 5):  # positions 1-2 hold the stop back, then none
            request = [DraftRequest("p", 11, 9, params, num_output=num_output)]
            expected = local.draft(request)[0]
            got = remote.draft(request)[0]
            assert torch.equal(got.tokens, expected.tokens), num_output
            assert int(got.tokens[0]) != int(raw[0])
    finally:
        remote.close()


def test_context_travels_with_the_first_draft_of_its_request(drafter_service, tiny_models):
    """Context appended in pieces is sent only when its request is drafted, all pieces joined:
    a request that is not drafted sends nothing, and the blocks still equal the in-process
    drafter's with the same context."""
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=1024)
    local = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    remote = RemoteDrafter(drafter_service)
    try:
        g = torch.Generator().manual_seed(1)
        width = local.fc.in_features
        pieces = {"a": [(0, 6), (6, 8)], "b": [(0, 5), (5, 7)]}
        for rid, spans in pieces.items():
            for first, end in spans:
                n = end - first
                features = torch.randn(n, width, generator=g)
                tokens = torch.randint(4, 60, (n,), generator=g)
                for d in (local, remote):
                    d.append_context(rid, features, torch.arange(first, end), tokens)
        greedy = SamplingParams(temperature=0)
        only_a = [DraftRequest("a", 11, 8, greedy)]
        assert torch.equal(remote.draft(only_a)[0].tokens, local.draft(only_a)[0].tokens)
        assert remote._contexts["a"].unsent == 0 and remote._contexts["b"].unsent == 2
        features, tokens = torch.randn(1, width, generator=g), torch.tensor([11])
        for d in (local, remote):
            d.append_context("a", features, torch.tensor([8]), tokens)
        both = [DraftRequest("a", 12, 9, greedy), DraftRequest("b", 13, 7, greedy)]
        for got, want in zip(remote.draft(both), local.draft(both)):
            assert torch.equal(got.tokens, want.tokens)
            assert torch.allclose(got.confidences, want.confidences, atol=1e-5)
        assert remote._contexts["b"].unsent == 0
    finally:
        remote.close()


def test_bad_position_count_is_invalid_argument(drafter_service):
    item = pb.drafter.DraftItem(request_id="x", anchor_token=5, anchor_position=0,
                                sampling=pb.common.SamplingParams(temperature=0.0, top_p=1.0))
    round_msg = pb.drafter.DraftRound(round_id=1, requests=[item], num_positions=99)
    with channel(drafter_service) as ch:
        stub = rpc.drafter.DrafterStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Draft(iter([round_msg]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_positions" in err.value.details()
