//! Placing a model on a device: the CPU always, a CUDA GPU when the build has the `cuda` feature
//! and the machine a GPU (the GPU forward itself is checked against the references by
//! `examples/cuda_model_check.rs` on the GPU machine), anything else refused with the reason.

use std::path::Path;

use tessera_engine::generate::prompt_logits;
use tessera_engine::Model;
use tessera_kernels::Device;

#[test]
fn a_model_runs_where_it_can_and_says_why_where_it_cannot() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/kl_mixed");
    let mut model = Model::load(&dir).unwrap();
    assert_eq!(model.device(), Device::Cpu);
    let on_cpu = prompt_logits(&model, &[5, 17, 42]).unwrap();

    let err = model.to_device(Device::Hip(0)).unwrap_err().to_string();
    assert!(err.contains("hip"), "unhelpful: {err}");
    assert_eq!(
        model.device(),
        Device::Cpu,
        "a refused device changes nothing"
    );

    match model.to_device(Device::Cuda(0)) {
        Ok(()) => assert_eq!(model.device(), Device::Cuda(0)),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("--features cuda") || msg.contains("CUDA") || msg.contains("libcuda"),
                "unhelpful: {msg}"
            );
            assert_eq!(model.device(), Device::Cpu);
        }
    }
    model.to_device(Device::Cpu).unwrap();
    assert_eq!(model.device(), Device::Cpu);
    assert_eq!(prompt_logits(&model, &[5, 17, 42]).unwrap(), on_cpu);
}
