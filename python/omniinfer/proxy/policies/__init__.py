"""Built-in stateless and cache-aware routing policies, one module each; every module here is
imported and registers itself with ``omniinfer.proxy.policy_api.register_policy`` (so a new
policy is one new file). The deferring policies (OAS and OmniInfer's shipped rules) live in
``omniinfer.proxy.oas``."""
