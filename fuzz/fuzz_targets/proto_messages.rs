//! Arbitrary bytes decoded as the messages workers, the router and the etcd client receive
//! (prost), and as the frames of the TCP page-transfer protocol. The first byte picks the type.
//! Decoding must fail cleanly or give a message that re-encodes to the same bytes on a second
//! round trip; the helpers that read decoded messages must not panic either.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_proto::etcd::pb as etcd;
use tessera_proto::prost::Message;
use tessera_proto::tonic::{Code, Status};
use tessera_proto::v1;
use tessera_transfer::region::Incarnation;
use tessera_transfer::tcp::wire::{
    Ack, ClientHello, ClientProof, ExtentHeader, ExtentTrailer, PartHeader, ServerHello, Verdict,
};

/// Decode `bytes` as `M`; when that succeeds, check that encoding is stable.
fn round_trip<M: Message + Default>(bytes: &[u8]) -> Option<M> {
    let msg = M::decode(bytes).ok()?;
    let once = msg.encode_to_vec();
    assert_eq!(once.len(), msg.encoded_len());
    let again = M::decode(once.as_slice()).expect("a re-encoded message decodes");
    assert_eq!(again.encode_to_vec(), once, "encoding is not stable");
    Some(msg)
}

fn page_layout(d: &v1::PageLayoutDescriptor) {
    assert_eq!(d.mismatch(d), None, "a layout must match itself");
    for dtype in [d.latent_dtype(), d.conv_dtype(), d.recurrent_dtype()] {
        let _ = dtype.size_bytes();
    }
}

fn worker_info(w: &v1::WorkerInfo) {
    let _ = w.role().name();
    let _ = w.transfer_backend().name();
    if let Some(layout) = &w.layout {
        page_layout(layout);
    }
    let _ = tessera_proto::check_incarnation(w.incarnation_id, w.incarnation_id, &w.worker_id);
}

fn error_detail(e: v1::ErrorDetail) {
    let code = e.code().grpc_code();
    let status = e.clone().into_status();
    assert_eq!(status.code(), code);
    let back = v1::ErrorDetail::from_status(&status);
    let encoded = e.encode_to_vec();
    if encoded.is_empty() {
        assert_eq!(back, None, "an all-default detail encodes to nothing");
    } else {
        let back = back.expect("the detail travels in the status");
        assert_eq!(back.encode_to_vec(), encoded);
    }
}

/// Frames are fixed-size: the first `LEN` bytes, when there are that many.
fn frame<const N: usize>(bytes: &[u8]) -> Option<&[u8; N]> {
    bytes.get(..N).and_then(|b| b.try_into().ok())
}

fn wire(kind: u8, bytes: &[u8]) {
    match kind % 8 {
        0 => {
            if let Some(Ok(h)) = frame(bytes).map(ClientHello::decode) {
                assert_eq!(ClientHello::decode(&h.encode()).ok(), Some(h));
            }
        }
        1 => {
            if let Some(Ok(h)) = frame(bytes).map(ServerHello::decode) {
                assert_eq!(ServerHello::decode(&h.encode()).ok(), Some(h));
            }
        }
        2 => {
            if let Some(Ok(p)) = frame(bytes).map(ClientProof::decode) {
                assert_eq!(ClientProof::decode(&p.encode()).ok(), Some(p));
            }
        }
        3 => {
            if let Some(Ok(v)) = frame(bytes).map(Verdict::decode) {
                assert_eq!(Verdict::decode(&v.encode()).ok(), Some(v));
            }
        }
        4 => {
            if let Some(Ok(p)) = frame(bytes).map(PartHeader::decode) {
                assert_eq!(PartHeader::decode(&p.encode()).ok(), Some(p));
            }
        }
        5 => {
            if let Some(e) = frame(bytes).map(ExtentHeader::decode) {
                assert_eq!(ExtentHeader::decode(&e.encode()), e);
            }
        }
        6 => {
            if let Some(t) = frame(bytes).map(ExtentTrailer::decode) {
                assert_eq!(ExtentTrailer::decode(&t.encode()), t);
            }
        }
        _ => {
            let Some(Ok((mut ack, len))) = frame(bytes).map(Ack::decode) else {
                return;
            };
            let rest = &bytes[Ack::LEN..];
            ack.message = String::from_utf8_lossy(&rest[..len.min(rest.len())]).into_owned();
            let _ = ack.into_result(Incarnation(1), Incarnation(2));
        }
    }
}

macro_rules! decode_one_of {
    ($selector:expr, $bytes:expr; $($ty:ty),+ $(,)?) => {{
        let types: &[fn(&[u8])] = &[$(|b| { round_trip::<$ty>(b); }),+];
        types[$selector as usize % types.len()]($bytes)
    }};
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    match selector >> 6 {
        0 => decode_one_of!(selector & 0x3f, bytes;
            v1::ReserveRequest,
            v1::ReserveReply,
            v1::ReleaseReservationRequest,
            v1::ReleaseReservationReply,
            v1::StartDecodeRequest,
            v1::TokenChunk,
            v1::TransferHandshakeRequest,
            v1::TransferHandshakeReply,
            v1::EncodeRequest,
            v1::EncodeReply,
            v1::ReleaseEmbeddingsRequest,
            v1::ReleaseEmbeddingsReply,
            v1::GenerateRequest,
            v1::GenerateResponse,
            v1::ListModelsRequest,
            v1::ListModelsResponse,
            v1::PrefillRequest,
            v1::PrefillReply,
            v1::StatsRequest,
            v1::WorkerStats,
            v1::CancelRequest,
            v1::CancelReply,
            v1::MemoryRegion,
            v1::EmbeddingHandle,
            etcd::RangeResponse,
            etcd::PutResponse,
            etcd::DeleteRangeResponse,
            etcd::WatchResponse,
            etcd::LeaseGrantResponse,
            etcd::LeaseRevokeResponse,
            etcd::LeaseKeepAliveResponse,
        ),
        1 => {
            if let Some(w) = round_trip::<v1::WorkerInfo>(bytes) {
                worker_info(&w);
            }
            if let Some(d) = round_trip::<v1::PageLayoutDescriptor>(bytes) {
                page_layout(&d);
            }
        }
        2 => {
            if let Some(e) = round_trip::<v1::ErrorDetail>(bytes) {
                error_detail(e);
            }
            let status = Status::with_details(Code::Internal, "fuzz", bytes.to_vec().into());
            let _ = v1::ErrorDetail::from_status(&status);
        }
        _ => wire(selector, bytes),
    }
});
