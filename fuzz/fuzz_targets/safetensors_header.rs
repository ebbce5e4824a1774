//! Arbitrary bytes as a checkpoint's `model.safetensors`, opened by the engine's loader
//! ([`Checkpoint::open`]) and read the way the model does (every tensor by name and shape,
//! converted to f32). A hostile header or data section must be a load error, never a panic or
//! an out-of-bounds read.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tessera_engine::Checkpoint;

/// One directory for the whole run (in memory where there is a tmpfs); every input overwrites
/// its `model.safetensors`.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("temp dir")
            .keep()
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = dir();
    std::fs::write(dir.join("model.safetensors"), data).expect("write the checkpoint");
    let Ok(ckpt) = Checkpoint::open(dir) else {
        return;
    };
    let names = ckpt.unused();
    for name in &names {
        let shape = ckpt
            .shape(name)
            .expect("a listed tensor has a shape")
            .to_vec();
        let numel = shape.iter().product::<usize>();
        let by_shape = ckpt.f32(name, &shape);
        let by_numel = ckpt.f32_numel(name, numel);
        match (by_shape, by_numel) {
            (Ok(a), Ok((b, found))) => {
                assert_eq!(a.len(), numel);
                assert_eq!(found, shape);
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
            (Err(_), Err(_)) => {}
            (a, b) => panic!("f32 and f32_numel disagree on `{name}`: {a:?} vs {b:?}"),
        }
        let mut wrong = shape.clone();
        wrong.push(2);
        assert!(ckpt.f32(name, &wrong).is_err());
    }
    assert!(ckpt.resolve(&["not.a.tensor"]).is_err());
    if !names.is_empty() {
        let all: Vec<&str> = names.iter().map(String::as_str).collect();
        assert_eq!(ckpt.resolve(&all).ok(), all.first().copied());
    }
});
