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
  colocated) module=services.colocated.main ;;
  http-adapter) module=gateway.http.main ;;
  envoy) module=gateway.envoy.main ;;
  batch) module=services.batch.main ;;
  # Fills the model volume $MESHSERVE_CACHE (only the `models` image has the
  # model wheels), lays any config.pbtxt overrides from $MESHSERVE_MODEL_CONFIGS
  # (files named <model>.pbtxt) over the prepared ones, then marks it ready.
  prepare-models)
    python -m models.prepare "$@"
    repository="${MESHSERVE_CACHE:?}/repository"
    for config in "${MESHSERVE_MODEL_CONFIGS:-/nonexistent}"/*.pbtxt; do
      [ -f "$config" ] || continue
      model="$(basename "$config" .pbtxt)"
      cp "$config" "$repository/$model/config.pbtxt"
      echo "[models] $model: config.pbtxt from $config"
    done
    touch "$MESHSERVE_CACHE/prepared"
    exit 0 ;;
  # An init container: waits until the prepare Job has filled the volume.
  wait-for-models)
    marker="${MESHSERVE_CACHE:-/models}/prepared"
    until [ -f "$marker" ]; do echo "waiting for $marker (the meshserve-prepare-models Job)"; sleep 5; done
    exit 0 ;;
  *)
    echo "usage: meshserve-entrypoint SERVICE [FLAGS...]; SERVICE is one of:" >&2
    echo "  orchestrator inference tokenizer preprocess postprocess colocated http-adapter envoy batch" >&2
    echo "  prepare-models wait-for-models" >&2
    exit 2 ;;
esac
exec python -m "$module" "$@"
