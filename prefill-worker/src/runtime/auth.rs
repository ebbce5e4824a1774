//! The cluster secret on gRPC calls: the client interceptor that adds it and the server one that
//! requires it.

use tessera_proto::tonic;
use tessera_proto::tonic::metadata::{Ascii, MetadataValue};
use tessera_proto::tonic::service::interceptor::Interceptor;
use tessera_proto::v1;

/// The cluster secret as gRPC metadata, `authorization: Bearer <secret>`: the router sends it on
/// every call to a worker, a prefill worker on its calls to decode, and every worker service
/// requires it ([`RequireToken`]).
#[derive(Clone)]
pub struct ClusterToken(MetadataValue<Ascii>);

impl ClusterToken {
    pub fn new(secret: &str) -> anyhow::Result<Self> {
        format!("Bearer {secret}")
            .parse()
            .map(ClusterToken)
            .map_err(|_| {
                anyhow::anyhow!(
                    "the cluster secret (TESSERA_AUTH_SECRET) is not valid in a gRPC header"
                )
            })
    }

    /// Refuses `metadata` unless it carries this token (compared in constant time).
    #[allow(clippy::result_large_err)] // tonic's Status is what interceptors return anyway
    pub fn check(&self, metadata: &tonic::metadata::MetadataMap) -> Result<(), tonic::Status> {
        let refuse = |why: &str| {
            Err(v1::ErrorDetail::new(v1::ErrorCode::Unauthenticated, why).into_status())
        };
        match metadata.get(AUTHORIZATION) {
            None => refuse("no `authorization` metadata: this worker requires the cluster secret"),
            Some(got) if constant_time_eq(got.as_bytes(), self.0.as_bytes()) => Ok(()),
            Some(_) => refuse("wrong cluster secret in `authorization`"),
        }
    }
}

const AUTHORIZATION: &str = "authorization";

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Client side: adds the token to every request (`XClient::with_interceptor(channel, token)`).
impl Interceptor for ClusterToken {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        r.metadata_mut().insert(AUTHORIZATION, self.0.clone());
        Ok(r)
    }
}

/// Server side: refuses every request without the cluster token, UNAUTHENTICATED.
#[derive(Clone)]
pub struct RequireToken(pub ClusterToken);

impl Interceptor for RequireToken {
    fn call(&mut self, r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        self.0.check(r.metadata())?;
        Ok(r)
    }
}
