"""Generated modules for meshserve's own API; see the versioned subpackages (v1)."""
