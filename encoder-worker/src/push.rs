//! Moving an image's embeddings into a prefill worker's buffer: `ReserveEmbeddings` on the
//! prefill worker (which answers with a registered region of its transport), then one
//! `write_bytes` of the row-major f32 values over this encoder's transport.
//!
//! Every failure here is the destination's (or the path to it), so it is reported as
//! TRANSFER_FAILED: the router then tries another prefill worker rather than another encoder.

use std::collections::HashMap;
use std::time::Duration;

use tessera_prefill::runtime::{self, ClusterToken};
use tessera_proto::tonic::service::interceptor::InterceptedService;
use tessera_proto::tonic::transport::Channel;
use tessera_proto::tonic::Status;
use tessera_proto::v1;
use tessera_proto::v1::prefill_worker_client::PrefillWorkerClient;
use tessera_transfer::{Incarnation, PeerId, RegionDescriptor, RegionId, TransferId, Transport};

use tessera_engine::vision::ImageEmbedding;

type PrefillClient = PrefillWorkerClient<InterceptedService<Channel, ClusterToken>>;

/// A prefill worker this encoder pushes to.
#[derive(Clone)]
struct Peer {
    client: PrefillClient,
    /// The transport peer, once connected, and the incarnation it belongs to.
    transfer: Option<(PeerId, u64)>,
}

fn failed(msg: impl Into<String>) -> Status {
    v1::ErrorDetail {
        retryable: true,
        ..v1::ErrorDetail::new(v1::ErrorCode::TransferFailed, msg)
    }
    .into_status()
}

/// Connections to prefill workers, by gRPC address.
pub struct Pusher {
    token: ClusterToken,
    tls: Option<tessera_proto::tls::MutualTls>,
    peers: tokio::sync::Mutex<HashMap<String, Peer>>,
}

/// Longest one push (reserve + write) may take.
const PUSH_TIMEOUT: Duration = Duration::from_secs(30);

impl Pusher {
    pub fn new(token: ClusterToken, tls: Option<tessera_proto::tls::MutualTls>) -> Self {
        Pusher {
            token,
            tls,
            peers: Default::default(),
        }
    }

    async fn client(&self, addr: &str) -> Result<PrefillClient, Status> {
        let mut peers = self.peers.lock().await;
        if let Some(p) = peers.get(addr) {
            return Ok(p.client.clone());
        }
        let channel = tessera_proto::tls::endpoint(addr, self.tls.as_ref())
            .map_err(|e| {
                v1::ErrorDetail::new(
                    v1::ErrorCode::InvalidArgument,
                    format!("prefill address: {e}"),
                )
                .into_status()
            })?
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy();
        let client = PrefillWorkerClient::with_interceptor(channel, self.token.clone());
        peers.insert(
            addr.to_string(),
            Peer {
                client: client.clone(),
                transfer: None,
            },
        );
        Ok(client)
    }

    /// The transport peer for the prefill worker at `addr` (life `incarnation`, reachable at
    /// `endpoint`), connected on first use and again after the worker restarted.
    async fn transfer_peer(
        &self,
        transport: &dyn Transport,
        addr: &str,
        incarnation: u64,
        endpoint: &str,
    ) -> Result<PeerId, Status> {
        if let Some((peer, inc)) = self.peers.lock().await.get(addr).and_then(|p| p.transfer) {
            if inc == incarnation {
                return Ok(peer);
            }
        }
        let deadline = tessera_transfer::Instant::now() + Duration::from_secs(10);
        let peer = transport
            .connect(endpoint, deadline)
            .await
            .map_err(|e| failed(format!("connecting to prefill transfer {endpoint}: {e}")))?;
        if let Some(p) = self.peers.lock().await.get_mut(addr) {
            p.transfer = Some((peer, incarnation));
        }
        Ok(peer)
    }

    /// Reserves a buffer on the destination and writes `e` into it; the handle names the
    /// prefill worker as holder.
    pub async fn push(
        &self,
        transport: &dyn Transport,
        me: &v1::WorkerInfo,
        request_id: &str,
        dest: &v1::EmbeddingDestination,
        ttl_ms: u32,
        e: &ImageEmbedding,
    ) -> Result<(v1::EmbeddingHandle, u64), Status> {
        let addr = dest.prefill_grpc_address.as_str();
        if addr.is_empty() {
            return Err(v1::ErrorDetail::new(
                v1::ErrorCode::InvalidArgument,
                "the destination names no prefill gRPC address",
            )
            .into_status());
        }
        let mut client = self.client(addr).await?;
        let ask = v1::ReserveEmbeddingsRequest {
            request_id: request_id.to_string(),
            target_incarnation: dest.prefill_incarnation_id,
            initiator: Some(me.clone()),
            n_tokens: e.n_tokens as u32,
            hidden: e.hidden as u32,
            dtype: v1::Dtype::F32 as i32,
            content_hash: e.content_hash.to_vec(),
            ttl_ms,
        };
        let reply = tokio::time::timeout(PUSH_TIMEOUT, client.reserve_embeddings(ask))
            .await
            .map_err(|_| failed(format!("prefill {addr} did not answer ReserveEmbeddings")))?
            .map_err(|s| {
                failed(format!(
                    "reserving embeddings on prefill {addr}: {}",
                    s.message()
                ))
            })?
            .into_inner();
        let (Some(handle), Some(region), Some(responder)) =
            (reply.handle, reply.region, reply.responder)
        else {
            return Err(failed(format!(
                "prefill {addr} answered ReserveEmbeddings without a handle or region"
            )));
        };
        runtime::transports_compatible(me, &responder)
            .map_err(|m| v1::ErrorDetail::new(v1::ErrorCode::LayoutMismatch, m).into_status())?;
        let endpoint = if dest.transfer_endpoint.is_empty() {
            responder.transfer_endpoint.clone()
        } else {
            dest.transfer_endpoint.clone()
        };
        let peer = self
            .transfer_peer(transport, addr, responder.incarnation_id, &endpoint)
            .await?;
        let dst = RegionDescriptor {
            region_id: RegionId(region.region_id.into()),
            len: region.length_bytes,
            incarnation: Incarnation(responder.incarnation_id),
            remote_key: region.remote_key,
        };
        let bytes: Vec<u8> = e.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let deadline = tessera_transfer::Instant::now() + PUSH_TIMEOUT;
        let write = transport
            .write_bytes(
                peer,
                TransferId(reply.transfer_id),
                &dst,
                0,
                &bytes,
                deadline,
            )
            .await;
        if let Err(err) = write {
            // A broken connection is dialled again next time.
            if let Some(p) = self.peers.lock().await.get_mut(addr) {
                p.transfer = None;
            }
            return Err(failed(format!(
                "writing embeddings to prefill {addr}: {err}"
            )));
        }
        Ok((handle, bytes.len() as u64))
    }
}
