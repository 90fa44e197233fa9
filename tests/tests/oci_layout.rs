//! `scripts/oci.sh` writes an OCI image layout that Istio's and Envoy Gateway's Wasm image
//! fetchers accept (the "compat" image: one tar+gzip layer holding `plugin.wasm`), checked here
//! without a registry: index → manifest → config and layer, every digest and size against its
//! blob, the media types, the config's diff_id against the uncompressed layer, and the module
//! inside the layer against the filter it was built from.

use serde_json::Value;
use sha2::{Digest, Sha256};
use sluice_e2e::paths::{filter_wasm, repo_root};
use std::path::{Path, PathBuf};
use std::process::Command;

const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs the script into a fresh directory with the locally built filter.
fn write_layout(name: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("sluice-oci-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let wasm = filter_wasm().expect("the filter (scripts/setup.sh)");
    let status = Command::new("bash")
        .arg(repo_root().join("scripts/oci.sh"))
        .arg(&out)
        .env("SLUICE_FILTER_WASM", &wasm)
        .env("SLUICE_OCI_TAG", "9.9.9-test")
        .status()
        .expect("running scripts/oci.sh");
    assert!(status.success(), "scripts/oci.sh failed: {status}");
    out
}

/// A descriptor's blob, after checking that its digest and size are the blob's.
fn blob(layout: &Path, descriptor: &Value) -> Result<Vec<u8>, String> {
    let digest = descriptor["digest"].as_str().ok_or("descriptor without digest")?;
    let hex = digest.strip_prefix("sha256:").ok_or_else(|| format!("{digest}: not sha256"))?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
        return Err(format!("{digest}: not a lowercase hex sha256"));
    }
    let bytes = std::fs::read(layout.join("blobs/sha256").join(hex)).map_err(|e| format!("blob {digest}: {e}"))?;
    if sha256_hex(&bytes) != hex {
        return Err(format!("blob {digest}: content hashes to sha256:{}", sha256_hex(&bytes)));
    }
    if descriptor["size"].as_u64() != Some(bytes.len() as u64) {
        return Err(format!("blob {digest}: size {} in the descriptor, {} on disk", descriptor["size"], bytes.len()));
    }
    Ok(bytes)
}

fn media_type(descriptor: &Value, want: &str) -> Result<(), String> {
    match descriptor["mediaType"].as_str() {
        Some(m) if m == want => Ok(()),
        other => Err(format!("media type {other:?}, expected {want}")),
    }
}

/// The files of an uncompressed ustar archive, as (name, content).
fn untar(tar: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let field = |h: &[u8], from: usize, to: usize| {
        String::from_utf8_lossy(&h[from..to]).trim_end_matches('\0').trim().to_string()
    };
    let mut files = Vec::new();
    let mut at = 0;
    while at + 512 <= tar.len() {
        let header = &tar[at..at + 512];
        if header.iter().all(|b| *b == 0) {
            return Ok(files);
        }
        let name = match field(header, 345, 500) {
            prefix if prefix.is_empty() => field(header, 0, 100),
            prefix => format!("{prefix}/{}", field(header, 0, 100)),
        };
        let size = usize::from_str_radix(&field(header, 124, 136), 8).map_err(|e| format!("{name}: size: {e}"))?;
        let body = tar.get(at + 512..at + 512 + size).ok_or_else(|| format!("{name}: truncated"))?;
        if matches!(header[156], b'0' | 0) {
            files.push((name, body.to_vec()));
        }
        at += 512 + size.div_ceil(512) * 512;
    }
    Err("archive without its end-of-archive blocks".into())
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("gzip")
        .args(["-dc"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("gzip");
    // Fed from another thread: a layer bigger than the pipe's buffer would otherwise block gzip
    // on its full stdout while this thread blocks on its full stdin.
    let mut stdin = child.stdin.take().unwrap();
    let input = bytes.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap().unwrap();
    assert!(out.status.success(), "the layer is not gzip");
    out.stdout
}

/// Everything a fetcher reads from the layout, checked; returns the module in the layer.
fn check_layout(layout: &Path, tag: &str) -> Result<Vec<u8>, String> {
    let read_json = |rel: &str| -> Result<Value, String> {
        let text = std::fs::read(layout.join(rel)).map_err(|e| format!("{rel}: {e}"))?;
        serde_json::from_slice(&text).map_err(|e| format!("{rel}: {e}"))
    };
    let oci_layout = read_json("oci-layout")?;
    if oci_layout["imageLayoutVersion"] != "1.0.0" {
        return Err(format!("oci-layout: {oci_layout}"));
    }
    let index = read_json("index.json")?;
    if index["schemaVersion"] != 2 {
        return Err("index.json: schemaVersion is not 2".into());
    }
    media_type(&index, INDEX).map_err(|e| format!("index.json: {e}"))?;
    let manifests = index["manifests"].as_array().ok_or("index.json: no manifests")?;
    let [descriptor] = manifests.as_slice() else { return Err(format!("index.json: {} manifests", manifests.len())) };
    if descriptor["annotations"]["org.opencontainers.image.ref.name"] != tag {
        return Err(format!("index.json: ref name is not {tag}"));
    }
    media_type(descriptor, MANIFEST).map_err(|e| format!("index.json manifest: {e}"))?;
    let manifest: Value = serde_json::from_slice(&blob(layout, descriptor)?).map_err(|e| format!("manifest: {e}"))?;
    if manifest["schemaVersion"] != 2 {
        return Err("manifest: schemaVersion is not 2".into());
    }
    media_type(&manifest, MANIFEST).map_err(|e| format!("manifest: {e}"))?;
    media_type(&manifest["config"], CONFIG).map_err(|e| format!("config: {e}"))?;
    let config: Value =
        serde_json::from_slice(&blob(layout, &manifest["config"])?).map_err(|e| format!("config: {e}"))?;
    let layers = manifest["layers"].as_array().ok_or("manifest: no layers")?;
    // The compat variant: exactly one layer (older Istio releases read only a single-layer image).
    let [layer] = layers.as_slice() else { return Err(format!("manifest: {} layers, expected 1", layers.len())) };
    media_type(layer, LAYER).map_err(|e| format!("layer: {e}"))?;
    let tar = gunzip(&blob(layout, layer)?);
    let diff_ids = config["rootfs"]["diff_ids"].as_array().ok_or("config: no rootfs.diff_ids")?;
    if config["rootfs"]["type"] != "layers"
        || diff_ids.len() != 1
        || diff_ids[0] != format!("sha256:{}", sha256_hex(&tar))
    {
        return Err(format!("config: rootfs {} does not name the uncompressed layer", config["rootfs"]));
    }
    for key in ["os", "architecture"] {
        if config[key].as_str().is_none_or(|s| s.is_empty()) {
            return Err(format!("config: no {key}"));
        }
    }
    let files = untar(&tar)?;
    match files.as_slice() {
        [(name, wasm)] if name == "plugin.wasm" => Ok(wasm.clone()),
        other => {
            Err(format!("layer holds {:?}, expected plugin.wasm alone", other.iter().map(|f| &f.0).collect::<Vec<_>>()))
        }
    }
}

/// The layout is complete and consistent, holds the very module that was built, and two runs
/// give the same bytes (the same digests, so a re-push is a no-op).
#[test]
fn oci_layout_holds_the_filter_as_a_compat_wasm_image() {
    let a = write_layout("a");
    let module = check_layout(&a, "9.9.9-test").unwrap_or_else(|e| panic!("{}: {e}", a.display()));
    assert_eq!(module, std::fs::read(filter_wasm().unwrap()).unwrap(), "plugin.wasm is not the filter");
    assert_eq!(&module[..4], b"\0asm", "plugin.wasm is not a Wasm module");
    let b = write_layout("b");
    for rel in ["index.json", "oci-layout"] {
        assert_eq!(
            std::fs::read(a.join(rel)).unwrap(),
            std::fs::read(b.join(rel)).unwrap(),
            "{rel} differs between runs"
        );
    }
    let _ = std::fs::remove_dir_all(&b);

    // The check itself fails on a broken layout: a blob changed after the fact, a wrong size,
    // a wrong media type.
    let index: Value = serde_json::from_slice(&std::fs::read(a.join("index.json")).unwrap()).unwrap();
    let manifest_digest =
        index["manifests"][0]["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap().to_string();
    let manifest_path = a.join("blobs/sha256").join(&manifest_digest);
    let manifest: Value = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let layer_path =
        a.join("blobs/sha256").join(manifest["layers"][0]["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap());
    let original = std::fs::read(&layer_path).unwrap();
    std::fs::write(&layer_path, [&original[..], b"x"].concat()).unwrap();
    let err = check_layout(&a, "9.9.9-test").unwrap_err();
    assert!(err.contains("content hashes to"), "{err}");
    std::fs::write(&layer_path, &original).unwrap();

    let mut bad = index.clone();
    bad["manifests"][0]["size"] = (index["manifests"][0]["size"].as_u64().unwrap() + 1).into();
    std::fs::write(a.join("index.json"), bad.to_string()).unwrap();
    let err = check_layout(&a, "9.9.9-test").unwrap_err();
    assert!(err.contains("size"), "{err}");
    bad["manifests"][0] = index["manifests"][0].clone();
    bad["manifests"][0]["mediaType"] = "application/vnd.docker.distribution.manifest.v2+json".into();
    std::fs::write(a.join("index.json"), bad.to_string()).unwrap();
    let err = check_layout(&a, "9.9.9-test").unwrap_err();
    assert!(err.contains("media type"), "{err}");
    std::fs::write(a.join("index.json"), index.to_string()).unwrap();
    check_layout(&a, "9.9.9-test").expect("restored layout");
    let _ = std::fs::remove_dir_all(&a);
}
