"""Weight sync from the TP/PP-sharded student into vLLM, through vLLM's weight-transfer API.

- ``source``: ``MegatronWeightSource``, Hugging Face-named full tensors rebuilt from the shards (vLLM ``WeightSource``).
- ``buckets``: packing a tensor stream into fixed-size byte buckets (both ends cut it the same way).
- ``transport``: the gloo group between trainer rank 0 and the vLLM workers, bucket send/receive with status checks.
- ``gloo_engine``: the worker- and trainer-side engines registered in vLLM's factories (CPU stand-in for NCCL).
- ``partial``: the worker side of a partial update (a LoRA student's adapted layers only).
- ``reload_fallback``: ``collective_rpc`` + ``reload_weights`` for a vLLM without the weight-transfer API.
- ``plugin``: idempotent registration (also a ``vllm.general_plugins`` entry point).

Only ``source`` and ``buckets`` import without vLLM.
"""
