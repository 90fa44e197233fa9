#!/usr/bin/env bash
# Builds the filter and writes it as an OCI image layout directory (no registry involved):
#   scripts/oci.sh [OUT_DIR]        (default out/oci/sluice-filter)
#
# The image is the "compat" Wasm image that Istio's WasmPlugin (`url: oci://...`) and Envoy
# Gateway's EnvoyExtensionPolicy (`code.type: Image`) pull: one layer,
# application/vnd.oci.image.layer.v1.tar+gzip, holding `plugin.wasm`. Being an ordinary image, it
# also mounts as a Kubernetes image volume (envoy/k8s/). Both fetchers also read the older
# two-layer "oci" variant (application/vnd.module.wasm.content.layer.v1+wasm); neither reads the
# application/vnd.wasm.content.layer.v1+wasm artifact, so that form is not written.
#
# Push it with any OCI-layout-aware tool, e.g.
#   skopeo copy oci:out/oci/sluice-filter:0.1.0 docker://REGISTRY/sluice-filter:0.1.0
#   oras cp --from-oci-layout out/oci/sluice-filter:0.1.0 REGISTRY/sluice-filter:0.1.0
#
# Environment: SLUICE_FILTER_WASM (use this module instead of building one), SLUICE_OCI_TAG
# (the layout's ref name; default: the workspace version), SLUICE_OCI_PLATFORM (os/arch written
# in the image config, default linux/amd64; the module itself runs anywhere).
# The output is reproducible: the same module gives the same digests.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

out="${1:-out/oci/sluice-filter}"
tag="${SLUICE_OCI_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)}"
platform="${SLUICE_OCI_PLATFORM:-linux/amd64}"
os="${platform%%/*}"
arch="${platform#*/}"
[ -n "$tag" ] || { echo "oci.sh: no tag (set SLUICE_OCI_TAG)" >&2; exit 1; }

wasm="${SLUICE_FILTER_WASM:-}"
if [ -z "$wasm" ]; then
  cargo build -p sluice-filter --target wasm32-wasip1 --release >&2
  wasm="$CARGO_TARGET_DIR/wasm32-wasip1/release/sluice_filter.wasm"
fi
[ -f "$wasm" ] || { echo "oci.sh: no module at $wasm" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/blobs/sha256"
blobs="$out/blobs/sha256"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }
# Stores a file as a blob and prints its digest.
store() {
  local d
  d="$(sha "$1")"
  cp "$1" "$blobs/$d"
  echo "$d"
}

# The layer: plugin.wasm alone, with fixed owner, mode and time so that it is reproducible.
cp "$wasm" "$work/plugin.wasm"
tar --format=ustar --owner=0 --group=0 --numeric-owner --mode=0644 --mtime=@0 \
  -C "$work" -cf "$work/layer.tar" plugin.wasm
diff_id="$(sha "$work/layer.tar")"
gzip -9 -n -c "$work/layer.tar" > "$work/layer.tar.gz"
layer="$(store "$work/layer.tar.gz")"
layer_size="$(size "$work/layer.tar.gz")"

printf '{"architecture":"%s","os":"%s","config":{},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
  "$arch" "$os" "$diff_id" > "$work/config.json"
config="$(store "$work/config.json")"
config_size="$(size "$work/config.json")"

printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}],"annotations":{"org.opencontainers.image.title":"sluice-filter","org.opencontainers.image.version":"%s"}}' \
  "$config" "$config_size" "$layer" "$layer_size" "$tag" > "$work/manifest.json"
manifest="$(store "$work/manifest.json")"
manifest_size="$(size "$work/manifest.json")"

printf '{"imageLayoutVersion":"1.0.0"}' > "$out/oci-layout"
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}' \
  "$manifest" "$manifest_size" "$tag" > "$out/index.json"

echo "oci.sh: wrote $out ($tag, manifest sha256:$manifest, plugin.wasm $(size "$wasm") bytes)" >&2
