"""vLLM's ``OffloadingConfig`` as the connector builds it, for the suite's specs: one engine, one
KV group unless given, a unique engine id per call (vLLM names its shared region after it)."""

import uuid

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)


def offloading_config(extra_config, *, layers=("layer",), worker_kv_bytes_per_block=4096,
                      blocks_per_chunk=1, world_size=1, events=False):
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, tuple(layers), 0),),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=f"kvbm-test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="test-model", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
            dcp_size=1, data_parallel_index=0, data_parallel_size=1,
            data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
        replicated_layout=False,
    )
