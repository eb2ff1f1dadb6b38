"""The one-host test bed: what this project runs on one machine to test, measure and show itself.

Real SGLang servers on the CPU engine and prefill/decode pairs of them, started for the tests,
the benchmarks and the demo (``servers.py``, ``pd_servers.py``), the demo itself
(``demo.py``, ``demo_report.py``; ``scripts/demo.sh``), and the small models they serve
(``models/``: SmolLM2-135M from its GGUF wheel, its MoE form, tiny random test models).

It uses the product (the child-process helper :mod:`omniinfer.child_process`, the CPU engine's
flags and environment :mod:`omniinfer.cpu.server_env`, ``omniinfer deploy``'s local run), and
nothing in the product imports it: test/test_import_layers.py checks that.
"""
