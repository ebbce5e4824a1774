//! A real tonic server on loopback: a trivial DecodeWorker plus the health service, called
//! through the generated clients.

use std::net::SocketAddr;
use std::pin::Pin;

use futures_util::Stream;
use tessera_proto::health::pb::health_check_response::ServingStatus;
use tessera_proto::health::pb::health_client::HealthClient;
use tessera_proto::health::pb::HealthCheckRequest;
use tessera_proto::tonic::transport::server::TcpIncoming;
use tessera_proto::tonic::transport::{Channel, Server};
use tessera_proto::tonic::{self, Request, Response, Status};
use tessera_proto::v1::decode_worker_client::DecodeWorkerClient;
use tessera_proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use tessera_proto::v1::*;

const INCARNATION: u64 = 0x1234_5678;
const PAGE_TOKENS: u32 = 4;

/// Reserves consecutive page IDs and "decodes" by counting up from the first token.
struct FakeDecode;

#[tonic::async_trait]
impl DecodeWorker for FakeDecode {
    async fn reserve_pages(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<ReserveReply>, Status> {
        let req = request.into_inner();
        tessera_proto::check_incarnation(req.target_incarnation, INCARNATION, "decode-test")?;
        if req.prompt_token_ids.is_empty() {
            return Err(ErrorDetail::new(ErrorCode::InvalidArgument, "empty prompt").into());
        }
        let pages = (req.prompt_token_ids.len() as u32).div_ceil(PAGE_TOKENS);
        Ok(Response::new(ReserveReply {
            reservation_id: format!("res-{}", req.request_id),
            incarnation_id: INCARNATION,
            cached_tokens: 0,
            mla_page_ids: (1..=pages).collect(),
            kda_state_page_ids: vec![100, 101],
            ttl_ms: 5_000,
        }))
    }

    async fn release_reservation(
        &self,
        _request: Request<ReleaseReservationRequest>,
    ) -> Result<Response<ReleaseReservationReply>, Status> {
        Ok(Response::new(ReleaseReservationReply::default()))
    }

    type StartDecodeStream = Pin<Box<dyn Stream<Item = Result<TokenChunk, Status>> + Send>>;

    async fn start_decode(
        &self,
        request: Request<StartDecodeRequest>,
    ) -> Result<Response<Self::StartDecodeStream>, Status> {
        let req = request.into_inner();
        let prompt = req.prompt_token_ids.len() as u32;
        let mut chunks = Vec::new();
        // Completion index 0 is the first token (already streamed by the router).
        for i in 1..req.max_tokens {
            let finished = i + 1 == req.max_tokens;
            chunks.push(Ok(TokenChunk {
                token_ids: vec![req.first_token + i],
                offset: i,
                finish_reason: if finished {
                    FinishReason::Length as i32
                } else {
                    FinishReason::Unspecified as i32
                },
                usage: finished.then_some(Usage {
                    prompt_tokens: prompt,
                    completion_tokens: req.max_tokens,
                    cached_tokens: req.cached_tokens,
                }),
                logprobs: vec![],
            }));
        }
        Ok(Response::new(Box::pin(futures_util::stream::iter(chunks))))
    }

    async fn cancel(
        &self,
        _request: Request<CancelRequest>,
    ) -> Result<Response<CancelReply>, Status> {
        Ok(Response::new(CancelReply::default()))
    }

    async fn stats(
        &self,
        _request: Request<StatsRequest>,
    ) -> Result<Response<WorkerStats>, Status> {
        Ok(Response::new(WorkerStats::default()))
    }

    async fn transfer_handshake(
        &self,
        _request: Request<TransferHandshakeRequest>,
    ) -> Result<Response<TransferHandshakeReply>, Status> {
        Err(Status::unimplemented("no transfer in this test"))
    }
}

async fn start_server() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (reporter, health) = tessera_proto::health::server::health_reporter();
    reporter
        .set_serving::<DecodeWorkerServer<FakeDecode>>()
        .await;
    tokio::spawn(async move {
        Server::builder()
            .add_service(health)
            .add_service(DecodeWorkerServer::new(FakeDecode))
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    addr
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn decode_worker_over_loopback() {
    let addr = start_server().await;
    let ch = channel(addr).await;
    let mut client = DecodeWorkerClient::new(ch.clone());

    // Unary: ReservePages.
    let prompt: Vec<u32> = (10..20).collect();
    let reply = client
        .reserve_pages(ReserveRequest {
            request_id: "r1".into(),
            target_incarnation: INCARNATION,
            prompt_token_ids: prompt.clone(),
            max_tokens: 5,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.reservation_id, "res-r1");
    assert_eq!(reply.mla_page_ids, vec![1, 2, 3]);
    assert_eq!(reply.kda_state_page_ids.len(), 2);

    // Server streaming: StartDecode.
    let mut stream = client
        .start_decode(StartDecodeRequest {
            request_id: "r1".into(),
            target_incarnation: INCARNATION,
            reservation_id: reply.reservation_id,
            prompt_token_ids: prompt,
            first_token: 500,
            max_tokens: 5,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut tokens = vec![500];
    let mut last = None;
    while let Some(chunk) = stream.message().await.unwrap() {
        assert_eq!(
            chunk.offset as usize,
            tokens.len(),
            "chunks arrive in order"
        );
        tokens.extend(&chunk.token_ids);
        last = Some(chunk);
    }
    assert_eq!(tokens, vec![500, 501, 502, 503, 504]);
    let last = last.unwrap();
    assert_eq!(last.finish_reason(), FinishReason::Length);
    assert_eq!(
        last.usage,
        Some(Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_tokens: 0
        })
    );

    // Errors carry an ErrorDetail; a stale incarnation is refused.
    let err = client
        .reserve_pages(ReserveRequest {
            request_id: "r2".into(),
            target_incarnation: INCARNATION + 1,
            prompt_token_ids: vec![1],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        ErrorDetail::from_status(&err).unwrap().code(),
        ErrorCode::StaleIncarnation
    );
    let err = client
        .reserve_pages(ReserveRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // grpc.health.v1: the server as a whole and the DecodeWorker service are SERVING.
    let mut health = HealthClient::new(ch);
    for service in ["", "tessera.v1.DecodeWorker"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status();
        assert_eq!(status, ServingStatus::Serving, "service {service:?}");
    }
}
