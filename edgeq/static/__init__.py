"""Static-shape deployment graphs: a with-past decoder specialized into the prefill and decode
pair NPU stacks run (``specialize``), their optional 8-bit KV cache (``kv_cache_int8``) and one
weights file shared by both graphs (``shared_weights``)."""
