"""OmniInfer for SGLang: OmniProxy, OmniPlacement and OmniAttn as an SGLang plugin overlay."""

__version__ = "0.1.0"
