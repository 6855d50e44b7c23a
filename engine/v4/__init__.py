"""DeepSeek-V4 (``DeepseekV4ForCausalLM``, model_type ``deepseek_v4``) in plain PyTorch.

One file per concept: :mod:`.config` (config.json as transformers reads it, legacy names
included), :mod:`.kv_spec` (what each layer kind caches, one spec per kind), :mod:`.cache`
(a contiguous per-request cache built from those specs), :mod:`.compressor` (token-group
compression and the lightning indexer), :mod:`.attention` (shared-KV MQA over a sliding window
plus compressed entries), :mod:`.hyper_connection` (mHC streams), :mod:`.moe` (sqrtsoftplus and
hash routing, clipped SwiGLU), :mod:`.expert_parallel` (routed experts over EP ranks),
:mod:`.model` (the decoder), :mod:`.loader` (DeepSeek's and
HF's tensor names), :mod:`.state_io` (a request's cache as the named tensors PD ships) and
:mod:`.block_table` (a request's paged blocks per KV group), :mod:`.paged_cache` (the rows
stored at those blocks). docs/engine.md "DeepSeek-V4" describes the maths.
"""
