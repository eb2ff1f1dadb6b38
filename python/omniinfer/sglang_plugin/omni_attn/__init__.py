"""OmniAttn inside SGLang: layer-level KV eviction (sink + recent) on compressed layers.

- :mod:`.plugin`: ``--omni-attn-pattern`` at launch (the pattern as SGLang hybrid-SWA settings)
  and the scheduler-side hooks (sink floor, sink-aware budget and pool sizes, early frees);
- :mod:`.backend`: compressed layers on ``--attention-backend torch_native``;
- :mod:`.triton_backend`: ``--attention-backend omni_triton`` (the ``omni_kernel_npu`` kernels);
- :mod:`.radix`: ``--radix-cache-backend omni_attn``, the sink-aware radix tree;
- :mod:`.pd`: the sink under PD disaggregation;
- :mod:`.status`: ``attn.json`` for ``GET /omni/attn``.

Importing this package imports no SGLang; the modules import it where they need it.
"""
