"""The mesh's front door: Envoy configuration and the HTTP adapters behind it."""
