use prost::Message;
use tonic::Code;

use crate::v1::*;

fn roundtrip<M: Message + Default + PartialEq + std::fmt::Debug>(msg: &M) {
    let bytes = msg.encode_to_vec();
    let back = M::decode(bytes.as_slice()).expect("decodes");
    assert_eq!(&back, msg);
}

fn layout() -> PageLayoutDescriptor {
    PageLayoutDescriptor {
        layout_version: 1,
        page_tokens: 16,
        planes: 2,
        plane_bytes: 4096,
        parents: 100,
        max_pages_per_parent: 4,
        groups: vec![
            CacheGroupLayout {
                kind: CacheGroupKind::Mla as i32,
                layers: vec![1, 3],
                pages_per_parent: 4,
                page_stride_bytes: 1024,
                page_payload_bytes: 1024,
            },
            CacheGroupLayout {
                kind: CacheGroupKind::Kda as i32,
                layers: vec![0, 2],
                pages_per_parent: 1,
                page_stride_bytes: 4096,
                page_payload_bytes: 3900,
            },
        ],
        dims: Some(KvDims {
            kda_heads: 2,
            kda_head_dim: 16,
            conv_kernel: 4,
            latent_dim: 16,
        }),
        latent_dtype: Dtype::F32 as i32,
        conv_dtype: Dtype::F32 as i32,
        recurrent_dtype: Dtype::F32 as i32,
    }
}

#[test]
fn messages_roundtrip() {
    roundtrip(&WorkerInfo {
        worker_id: "decode-0".into(),
        incarnation_id: 0xdead_beef_0123_4567,
        role: Role::Decode as i32,
        model_id: "tiny".into(),
        grpc_address: "127.0.0.1:50051".into(),
        transfer_endpoint: "127.0.0.1:7400".into(),
        transfer_backend: TransferBackend::Tcp as i32,
        layout: Some(layout()),
        max_running: 64,
        max_context_tokens: 4096,
        version: "0.1.0".into(),
    });
    roundtrip(&ReserveReply {
        reservation_id: "r-1".into(),
        incarnation_id: 7,
        cached_tokens: 32,
        mla_page_ids: vec![5, 6, 9],
        kda_state_page_ids: vec![11, 12, 13],
        ttl_ms: 30_000,
    });
    roundtrip(&StartDecodeRequest {
        request_id: "req".into(),
        reservation_id: "r-1".into(),
        prompt_token_ids: vec![1, 2, 3, u32::MAX],
        first_token: 42,
        sampling: Some(SamplingParams {
            temperature: 0.7,
            top_p: Some(0.9),
            top_k: 40,
            seed: Some(1),
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            logit_bias: vec![LogitBias {
                token_id: 7,
                bias: -100.0,
            }],
        }),
        max_tokens: 16,
        stop_token_ids: vec![2],
        ..Default::default()
    });
    roundtrip(&GenerateRequest {
        model: "tiny".into(),
        prompt: Some(generate_request::Prompt::TokenIds(TokenIds {
            ids: vec![1, 2],
        })),
        stream: true,
        ..Default::default()
    });
    roundtrip(&GenerateRequest {
        prompt: Some(generate_request::Prompt::Text("hello".into())),
        stop: vec!["\n".into()],
        ..Default::default()
    });
    roundtrip(&TokenChunk {
        token_ids: vec![3, 4],
        offset: 1,
        finish_reason: FinishReason::Length as i32,
        usage: Some(Usage {
            prompt_tokens: 4,
            completion_tokens: 3,
            cached_tokens: 0,
        }),
        logprobs: vec![],
    });
    roundtrip(&EncodeReply {
        handles: vec![EmbeddingHandle {
            handle_id: "e-1".into(),
            n_tokens: 64,
            hidden: 128,
            dtype: Dtype::Bf16 as i32,
            content_hash: vec![0xab; 32],
            holder_worker_id: "prefill-0".into(),
            holder_incarnation_id: 3,
        }],
        compute_us: 10,
        transfer: None,
    });
}

#[test]
fn unset_optional_fields_decode_as_defaults() {
    // An empty buffer is a valid message of every type: proto3 zero values.
    let s = SamplingParams::decode(&[][..]).unwrap();
    assert_eq!(s.temperature, 0.0);
    assert_eq!(s.top_p, None);
    assert_eq!(s.seed, None);
    let c = TokenChunk::decode(&[][..]).unwrap();
    assert_eq!(c.finish_reason(), FinishReason::Unspecified);
}

#[test]
fn role_and_backend_names() {
    for role in [Role::Encoder, Role::Prefill, Role::Decode] {
        assert_eq!(role.to_string().parse::<Role>(), Ok(role));
        assert_eq!(role.as_str_name().parse::<Role>(), Ok(role));
    }
    assert_eq!(" Decode ".parse::<Role>(), Ok(Role::Decode));
    assert!("router".parse::<Role>().is_err());
    assert!("unspecified".parse::<Role>().is_err());
    assert!("ROLE_UNSPECIFIED".parse::<Role>().is_err());
    for b in [
        TransferBackend::Local,
        TransferBackend::Tcp,
        TransferBackend::Ucx,
    ] {
        assert_eq!(b.to_string().parse::<TransferBackend>(), Ok(b));
    }
    assert_eq!(FinishReason::Stop.to_string(), "stop");
    assert_eq!(FinishReason::Length.name(), Some("length"));
    assert_eq!(FinishReason::Unspecified.name(), None);
}

#[test]
fn error_detail_travels_in_status() {
    let mut detail = ErrorDetail::new(ErrorCode::OutOfPages, "need 12 pages, 3 free");
    detail.retryable = true;
    detail.worker_id = "decode-1".into();
    let status: tonic::Status = detail.clone().into();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(status.message(), "need 12 pages, 3 free");
    assert_eq!(ErrorDetail::from_status(&status), Some(detail));
    assert_eq!(
        ErrorDetail::from_status(&tonic::Status::unavailable("conn refused")),
        None
    );
}

#[test]
fn incarnation_check() {
    assert!(crate::check_incarnation(0, 5, "w").is_ok());
    assert!(crate::check_incarnation(5, 5, "w").is_ok());
    let err = crate::check_incarnation(4, 5, "w").unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    let detail = ErrorDetail::from_status(&err).unwrap();
    assert_eq!(detail.code(), ErrorCode::StaleIncarnation);
    assert_eq!(detail.incarnation_id, 5);
}

#[test]
fn layout_mismatch_names_the_field() {
    let a = layout();
    let mut b = layout();
    b.parents = 7; // budgets differ: fine
    assert_eq!(a.mismatch(&b), None);
    b.page_tokens = 32;
    assert_eq!(
        a.mismatch(&b).as_deref(),
        Some("page_tokens: 16 here, 32 there")
    );
    let mut c = layout();
    c.recurrent_dtype = Dtype::Bf16 as i32;
    assert!(a.mismatch(&c).unwrap().starts_with("recurrent_dtype"));
    let mut d = layout();
    d.groups[1].layers = vec![0, 3];
    assert!(a.mismatch(&d).unwrap().starts_with("groups[1]"));
    assert_eq!(Dtype::Bf16.size_bytes(), Some(2));
}

#[test]
fn descriptor_set_lists_every_file() {
    let fds = prost_types_free_decode(crate::FILE_DESCRIPTOR_SET);
    for f in [
        "tessera/v1/worker.proto",
        "tessera/v1/decode.proto",
        "tessera/v1/prefill.proto",
        "tessera/v1/encoder.proto",
        "tessera/v1/generate.proto",
    ] {
        assert!(fds.iter().any(|n| n == f), "{f} missing from {fds:?}");
    }
}

/// File names in an encoded FileDescriptorSet, without depending on prost-types: field 1 of the
/// set is `repeated FileDescriptorProto file`, whose field 1 is `string name`.
fn prost_types_free_decode(bytes: &[u8]) -> Vec<String> {
    #[derive(Clone, PartialEq, prost::Message)]
    struct File {
        #[prost(string, tag = "1")]
        name: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct Set {
        #[prost(message, repeated, tag = "1")]
        file: Vec<File>,
    }
    Set::decode(bytes)
        .unwrap()
        .file
        .into_iter()
        .map(|f| f.name)
        .collect()
}
