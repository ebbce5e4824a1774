//! Checkpoints that do not match their config fail at load with an error that names the tensor
//! (or file, or field) and the problem — never a panic.

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use tessera_engine::init_model::{write_model, Preset};
use tessera_engine::Model;

/// Rewrites `model.safetensors`, letting `edit` drop or replace tensors.
fn rewrite(
    dir: &Path,
    edit: impl Fn(&str, Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if let Some((dt, shape, data)) = edit(
            &name,
            view.dtype(),
            view.shape().to_vec(),
            view.data().to_vec(),
        ) {
            kept.push((name, dt, shape, data));
        }
    }
    let views: Vec<(String, TensorView)> = kept
        .iter()
        .map(|(n, dt, s, d)| (n.clone(), TensorView::new(*dt, s.clone(), d).unwrap()))
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(&path, out).unwrap();
}

fn fresh() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), Preset::Tiny, 3).unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

const VICTIM: &str = "model.layers.1.self_attn.dt_bias";

#[test]
fn intact_model_loads() {
    let d = fresh();
    Model::load(d.path()).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let d = fresh();
    rewrite(d.path(), |n, dt, s, b| (n != VICTIM).then_some((dt, s, b)));
    let e = load_err(d.path());
    assert!(e.contains(VICTIM) && e.contains("missing"), "{e}");
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let d = fresh();
    let name = "model.layers.0.self_attn.f_a_proj.weight";
    rewrite(d.path(), |n, dt, mut s, b| {
        if n == name {
            s.reverse();
        }
        Some((dt, s, b))
    });
    let e = load_err(d.path());
    assert!(e.contains(name) && e.contains("shape"), "{e}");
}

#[test]
fn unsupported_dtype_is_named() {
    let d = fresh();
    let name = "model.layers.1.self_attn.b_proj.weight";
    rewrite(d.path(), |n, dt, s, b| {
        if n == name {
            // BF16 bytes relabelled as 16-bit integers: a dtype the engine does not take.
            Some((Dtype::I16, s, b))
        } else {
            Some((dt, s, b))
        }
    });
    let e = load_err(d.path());
    assert!(e.contains(name) && e.contains("dtype"), "{e}");
}

#[test]
fn truncated_file_is_reported() {
    let d = fresh();
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 1000]).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("not valid safetensors"),
        "{e}"
    );
}

#[test]
fn garbage_header_is_reported() {
    let d = fresh();
    std::fs::write(
        d.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all",
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("not valid safetensors"), "{e}");
}

#[test]
fn config_that_disagrees_with_the_weights_names_the_tensor() {
    let d = fresh();
    let p = d.path().join("config.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"hidden_size\": 128", "\"hidden_size\": 96");
    std::fs::write(&p, text).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.embed_tokens.weight") && e.contains("[1024, 96]"),
        "{e}"
    );
}

#[test]
fn missing_config_and_missing_weights_are_reported() {
    let d = fresh();
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(load_err(d.path()).contains("config.json"));
    let d = fresh();
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert!(load_err(d.path()).contains("safetensors"));
}

#[test]
fn shard_index_naming_a_missing_file_is_reported() {
    let d = fresh();
    let index = serde_json::json!({"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}});
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}

#[test]
fn a_log_with_the_wrong_head_count_is_named() {
    let d = fresh();
    rewrite(d.path(), |n, dt, s, b| {
        if n == "model.layers.0.self_attn.A_log" {
            Some((dt, vec![2], b[..2 * dt.bitsize() / 8].to_vec()))
        } else {
            Some((dt, s, b))
        }
    });
    let e = load_err(d.path());
    assert!(e.contains("model.layers.0.self_attn.A_log"), "{e}");
}
