"""What a user would otherwise pick, written here so every benchmark has a peer to be compared with.

- `python_lists`: per-token Python lists, as small educational engines build their inputs.
- `numpy_vectorised`: persistent NumPy arrays and index arithmetic, as vLLM v1's CPU path does (no validation).
- `dense_sdpa`: attention without paging, torch's scaled_dot_product_attention on contiguous per-request KV.

Each is checked against spec in tests/test_bench_smoke.py, so no benchmark times a wrong answer.
"""
