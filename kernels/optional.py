"""The one import site for optional accelerator packages."""

try:
    from flash_attn import flash_attn_func, flash_attn_with_kvcache
except ImportError:  # flash-attn is an optional extra; CPU installs never have it
    flash_attn_func = flash_attn_with_kvcache = None

__all__ = ["flash_attn_func", "flash_attn_with_kvcache"]
