"""The engine trial on one lent H100/H200 (bench/gpu_engine.md): one host, the machine the
trial runs on. The example fleet's model and context at tensor parallel 1 (one GPU), the
stack whose torch the lent machines carry, the benchmark at the post's shape (8,192-token
prompts) with 256 output tokens, 16 at once, 32 requests."""

gpu_trial = [
    (
        "gpu-trial",
        {
            "vllm_device": "cuda",
            "vllm_version": "0.22.0",
            # The lent machines run driver 580.159.04.
            "nvidia_driver_branch": "580-server",
            "model_id": "Qwen/Qwen3.6-27B",
            "tensor_parallel_size": 1,
            "dtype": "bfloat16",
            "max_model_len": 131072,
            "bench_input_len": 8192,
            "bench_output_len": 256,
            "bench_concurrency": 16,
            "bench_requests": 32,
            # A trial has no gateway (its engine gets a key of its own, on loopback); the
            # settings still ask what a served host's gateway would do.
            "gateway_open": True,
        },
    ),
]
