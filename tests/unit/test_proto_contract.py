"""The committed gRPC stubs match proto/, and the step messages survive the trip through protobuf."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import convert
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import (
    BlockRequest,
    BlockStepRequest,
    BlockStepResult,
    BlockTransfer,
    ExecuteRequest,
    ExecuteResult,
    ExecuteStep,
    PromptLogprobs,
    RequestOutput,
    SampledToken,
    join_outputs,
)

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_not_stale(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
        cwd=ROOT, check=True,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for relative in generated:
        committed = ROOT / relative
        assert committed.is_file(), f"{relative} is not committed: run make proto"
        assert committed.read_bytes() == (tmp_path / relative).read_bytes(), f"{relative} is stale: run make proto"


def test_block_step_round_trip():
    request = BlockStepRequest(
        scheduler_id="s", executor_epoch="e", step_id=8, executed_step_ids=[6, 7], failed_request_ids=["f"],
        planned_step_id=7,
        free_request_ids=["gone"],
        running=[BlockRequest("b", 5, new_token_ids=[9], new_tokens_start=4), BlockRequest("c", 8)],
        waiting=[BlockRequest("a", 17, prompt_token_ids=[1, 2, 3], cache_salt="tenant")], lookahead_slots=16,
    )
    assert convert.block_step_request_from_proto(convert.block_step_request_to_proto(request)) == request
    result = BlockStepResult(
        {"a": [4, 5], "b": [9]}, {"a": 32, "b": 0}, ["c"],
        tier_loads={"a": [BlockTransfer(4, b"\x01" * 32), BlockTransfer(5, b"\x09" * 32, num_tokens=3)]},
        saves_before=[BlockTransfer(7, b"\x02" * 32)], saves_after=[BlockTransfer(5, b"\x03" * 32)],
        swap_out=[BlockTransfer(6, b"\x07" * 32)], swap_free=[b"\x08" * 32], num_slots={"a": 48, "b": 32},
    )
    assert convert.block_step_result_from_proto(convert.block_step_result_to_proto(result)) == result
    # A running request served without new blocks needs no delta: it does not travel.
    result.new_block_ids["d"], result.num_cached_tokens["d"] = [], 0
    message = convert.block_step_result_to_proto(result)
    assert "d" not in message.deltas
    back = convert.block_step_result_from_proto(message)
    assert "d" not in back.new_block_ids and back.new_block_ids.get("d", []) == []


def test_execute_step_round_trip():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=3, max_tokens=None,
                            min_tokens=2, stop_token_ids=[4], ignore_eos=True, logprobs=2, prompt_logprobs=0)
    step = ExecuteStep(
        requests=[
            ExecuteRequest("a", [1, 2, 3], 0, [7], True, params, prompt_len=3,
                           load_blocks=[BlockTransfer(7, b"\x04" * 32), BlockTransfer(8, b"\x09" * 32, 2)]),
            ExecuteRequest("c", [4, 5], 16, [], False),  # a prefill chunk that does not sample
            ExecuteRequest("g", [6], 31, [], True, feed_sampled=True),  # not a decode: two tokens
            ExecuteRequest("f", [9], 40, [], True, prompt_logprobs=True),  # not a decode: it asks for more
            # Decodes go as parallel arrays, the sampled token fed in or a known one, new blocks sparse.
            ExecuteRequest("b", [9], 40, [], True),
            ExecuteRequest("d", [], 17, [3, 8], True, feed_sampled=True),
            ExecuteRequest("e", [], 64, [], True, feed_sampled=True),
        ],
        finished_request_ids=["x"], executor_epoch="e1", scheduler_id="s1",
        save_blocks=[BlockTransfer(1, b"\x05" * 32)], save_blocks_after=[BlockTransfer(2, b"\x06" * 32)],
        swap_out=[BlockTransfer(3, b"\x07" * 32)], swap_free=[b"\x08" * 32], step_id=12,
    )
    message = convert.execute_step_to_proto(step)
    assert [r.request_id for r in message.requests] == ["a", "c", "g", "f"]
    assert list(message.decodes.request_ids) == ["b", "d", "e"] and list(message.decodes.token_ids) == [9, -1, -1]
    assert list(message.decodes.block_rows) == [1, 1] and list(message.decodes.block_ids) == [3, 8]
    assert convert.execute_step_from_proto(message) == (step, {})
    # A request whose sampling parameters do not validate is set aside alone, with the reason.
    message = convert.execute_step_to_proto(step)
    message.requests[0].sampling.temperature = -1.0
    back, rejected = convert.execute_step_from_proto(message)
    assert [r.request_id for r in back.requests] == ["c", "g", "f", "b", "d", "e"] and "temperature" in rejected["a"]
    result = ExecuteResult(
        sampled={"a": SampledToken(5, -0.25, [5, 6], [-0.25, -2.0]), "b": SampledToken(8), "c": SampledToken(1, 0.0, [], [])},
        num_prefill_tokens=3, num_decode_tokens=1, num_loaded_blocks=2, num_failed_loads=1,
        rejected={"d": "token id 10**9 out of range"},
        prompt_logprobs={"a": PromptLogprobs(1, [SampledToken(2, -1.5, [3], [-0.5]), SampledToken(3, -0.5, [], [])])},
        deferred=["e"],
    )
    back = convert.execute_result_from_proto(convert.execute_result_to_proto(result))
    assert back == result  # a logprob of exactly 0.0 is kept, not mistaken for "none asked"


def test_running_requests_whose_arrays_do_not_line_up_are_refused_naming_the_field():
    import pytest

    request = BlockStepRequest(running=[BlockRequest("b", 5, new_token_ids=[9, 8], new_tokens_start=3)])
    for field, value in (("num_tokens", [5, 6]), ("num_new_tokens", [3]), ("num_new_tokens", [-1])):
        message = convert.block_step_request_to_proto(request)
        getattr(message.running, field)[:] = value
        with pytest.raises(ValueError, match=field):
            convert.block_step_request_from_proto(message)


def test_running_requests_name_their_executors_by_index():
    import pytest

    request = BlockStepRequest(running=[BlockRequest("a", 5, executor_id="e:1"), BlockRequest("b", 6, executor_id="e:2"),
                                        BlockRequest("c", 7, executor_id="e:1")])
    message = convert.block_step_request_to_proto(request)
    assert (list(message.running.executors), list(message.running.executor_indexes)) == (["e:1", "e:2"], [0, 1, 0])
    assert convert.block_step_request_from_proto(message) == request
    for field, value in (("executor_indexes", [0, 1]), ("executor_indexes", [0, 2, 0])):
        message = convert.block_step_request_to_proto(request)
        getattr(message.running, field)[:] = value
        with pytest.raises(ValueError, match="executor_indexes"):
            convert.block_step_request_from_proto(message)


def test_outputs_of_several_steps_are_joined_per_request():
    from pagedserve.step import RequestOutput, join_outputs

    token = lambda t: SampledToken(t, -0.5, [t], [-0.5])  # noqa: E731
    outputs = [
        RequestOutput("a", [1], [token(1)], num_output_tokens=1, queue_time_s=0.5, prefill_time_s=0.25),
        RequestOutput("b", [7], num_output_tokens=4),
        RequestOutput("a", [2], [token(2)], num_output_tokens=2),
        RequestOutput("a", [], None, finish_reason="abort", num_output_tokens=2),
        RequestOutput("b", [8], finish_reason="length", num_output_tokens=5),
    ]
    assert join_outputs(outputs) == [
        RequestOutput("a", [1, 2], [token(1), token(2)], finish_reason="abort", num_output_tokens=2,
                      queue_time_s=0.5, prefill_time_s=0.25),  # (sent once: they stay with the joined output)
        RequestOutput("b", [7, 8], finish_reason="length", num_output_tokens=5),
    ]


def test_decode_rows_that_do_not_line_up_are_refused_naming_the_field():
    import pytest

    step = ExecuteStep([ExecuteRequest("b", [], 40, [5], True, feed_sampled=True)])
    for field, value in (("positions", [1, 2]), ("block_rows", [3])):
        message = convert.execute_step_to_proto(step)
        getattr(message.decodes, field)[:] = value
        with pytest.raises(ValueError, match=field):
            convert.execute_step_from_proto(message)


def test_request_output_round_trip():
    from pagedserve.v1 import scheduler_pb2

    output = RequestOutput("a", [5], [SampledToken(5, -0.5, [5], [-0.5])], "length", num_prompt_tokens=3,
                           num_output_tokens=1, prompt_logprobs=[SampledToken(2, -1.0, [], []), SampledToken(4, -2.0, [], [])])
    message = convert.request_output_to_proto(output, scheduler_pb2.RequestOutput())
    assert convert.request_output_from_proto(message) == output
    first = RequestOutput("a", [5], num_prompt_tokens=3, num_output_tokens=1, queue_time_s=0.0, prefill_time_s=1.5)
    message = convert.request_output_to_proto(first, scheduler_pb2.RequestOutput())
    assert convert.request_output_from_proto(message) == first  # a queue time of 0 stays set


def test_scheduler_update_sends_plain_token_outputs_as_columns_and_joins_steps():
    outputs = [
        RequestOutput("a", [5], num_prompt_tokens=3, num_output_tokens=1),
        RequestOutput("b", [7], [SampledToken(7, -0.25, [7], [-0.25])], num_prompt_tokens=2, num_output_tokens=4),
        RequestOutput("c", [], finish_reason="error", error="bad block id"),
        RequestOutput("a", [6], num_prompt_tokens=3, num_output_tokens=2),
        RequestOutput("d", [9, 10], num_prompt_tokens=8, num_output_tokens=2),
        RequestOutput("e", [11], finish_reason="stop", num_prompt_tokens=1, num_output_tokens=3),
        RequestOutput("f", [12], num_prompt_tokens=4, num_output_tokens=1, queue_time_s=0.1, prefill_time_s=0.2),
    ]
    message = convert.scheduler_update_to_proto(outputs)
    assert list(message.tokens.request_ids) == ["a", "d"]
    assert list(message.tokens.new_token_ids) == [5, 6, 9, 10]
    assert [m.request_id for m in message.outputs] == ["b", "c", "e", "f"]
    decoded = convert.scheduler_update_from_proto(type(message).FromString(message.SerializeToString()))
    by_id = {output.request_id: output for output in decoded}
    assert len(decoded) == 6
    assert by_id == {output.request_id: output for output in join_outputs(outputs)}


def test_token_columns_that_do_not_line_up_are_refused_naming_the_field():
    import pytest

    for field, value in (("num_new_tokens", [1, 1]), ("num_output_tokens", []), ("new_token_ids", [5, 6, 7])):
        message = convert.scheduler_update_to_proto([RequestOutput("a", [5, 6], num_prompt_tokens=3,
                                                                   num_output_tokens=2)])
        getattr(message.tokens, field)[:] = value
        with pytest.raises(ValueError, match="num_new_tokens" if field == "new_token_ids" else field):
            convert.scheduler_update_from_proto(message)


def test_default_sampling_fields_take_vllm_defaults():
    from pagedserve.v1 import common_pb2

    params = convert.sampling_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams()
    for structured in (SamplingParams(regex="[0-9]+"), SamplingParams(choice=["a", "b c"])):
        assert convert.sampling_from_proto(convert.sampling_to_proto(structured)) == structured


def test_a_seed_travels_as_its_64_bits_which_seed_the_sampler_alike():
    from executor_svc.sampler import mix_seed

    for seed, wire in [((1 << 64) - 1, -1), (1 << 63, -(1 << 63)), ((1 << 63) - 1, (1 << 63) - 1), (-5, -5)]:
        back = convert.sampling_from_proto(convert.sampling_to_proto(SamplingParams(seed=seed)))
        assert back.seed == wire and mix_seed(back.seed, 7) == mix_seed(seed, 7)


def test_a_negative_lookahead_is_refused_by_name():
    message = convert.block_step_request_to_proto(BlockStepRequest(step_id=1))
    message.lookahead_slots = -1
    with pytest.raises(ValueError, match="lookahead_slots"):
        convert.block_step_request_from_proto(message)
