"""The executor service: one batched Execute call per engine step."""
from __future__ import annotations

import threading

from executor_svc.model_runner import ModelRunner
from executor_svc.offload import HostTier, RedisTier
from pagedserve.convert import execute_result_to_proto, execute_step_from_proto
from pagedserve.v1 import executor_pb2, executor_pb2_grpc


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner, model_name: str) -> None:
        self.runner = runner
        self.model_name = model_name
        self.lock = threading.Lock()  # the runner's request state is driven by one step at a time

    def Execute(self, request, context):
        step = execute_step_from_proto(request)
        with self.lock:
            result = self.runner.execute(step)
        return execute_result_to_proto(result)

    def GetInfo(self, request, context):
        runner = self.runner
        tier = runner.offload_tier
        return executor_pb2.ExecutorInfo(
            model=self.model_name, model_dir=str(runner.model_dir), model_id=runner.model_id,
            num_blocks=runner.num_blocks, block_bytes=runner.block_bytes,
            block_size=runner.block_size, max_model_len=runner.max_model_len,
            vocab_size=runner.config.vocab_size, eos_token_ids=list(runner.eos_token_ids),
            attention_backend=runner.attention_backend_name, device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            num_prefill_tokens=runner.num_prefill_tokens, num_decode_tokens=runner.num_decode_tokens,
            offload=tier.name if tier else "none", blocks_saved=runner.blocks_saved,
            blocks_loaded=runner.blocks_loaded, failed_loads=runner.failed_loads,
            bytes_moved=runner.bytes_saved + runner.bytes_loaded, tier_errors=tier.errors if tier else 0,
            offload_capacity_blocks=tier.capacity_bytes // runner.block_bytes if isinstance(tier, HostTier) else 0,
            offload_redis_url=tier.url if isinstance(tier, RedisTier) else "",
        )
