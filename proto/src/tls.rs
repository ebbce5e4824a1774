//! Mutual TLS for the gRPC connections inside a cluster (router → workers, prefill → decode),
//! an option on top of the cluster secret: every process presents a certificate signed by the
//! cluster's CA and accepts only peers whose certificate that CA signed. A stray client then
//! cannot even open a connection, and traffic between nodes is encrypted.

use std::path::PathBuf;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// The flags every daemon (router, workers) shares. All three or none.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// PEM certificate (chain) this process presents to its peers. With --tls-key and --tls-ca,
    /// every gRPC connection between the router and the workers is mutual TLS.
    #[arg(long, env = "TESSERA_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "TESSERA_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate of the cluster CA: peers must present a certificate it signed, and their
    /// certificate must name the host they are reached at (DNS name or IP address).
    #[arg(long, env = "TESSERA_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
}

/// A process's TLS identity and the CA it trusts.
#[derive(Debug, Clone)]
pub struct MutualTls {
    identity: Identity,
    ca: Certificate,
}

fn read(what: &str, path: &PathBuf) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("--tls-{what} {}: {e}", path.display()))
}

impl TlsArgs {
    /// The configured identity; `None` without the flags (plain HTTP/2 on the cluster network).
    pub fn load(&self) -> Result<Option<MutualTls>, String> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca)
        else {
            return Ok(None);
        };
        let (cert, key, ca) = (read("cert", cert)?, read("key", key)?, read("ca", ca)?);
        for (what, pem, tag) in [
            ("cert", &cert, "CERTIFICATE"),
            ("key", &key, "PRIVATE KEY"),
            ("ca", &ca, "CERTIFICATE"),
        ] {
            if !String::from_utf8_lossy(pem).contains(tag) {
                return Err(format!("--tls-{what}: no PEM {tag} block in the file"));
            }
        }
        Ok(Some(MutualTls {
            identity: Identity::from_pem(cert, key),
            ca: Certificate::from_pem(ca),
        }))
    }

    /// The same flags on a command line (for a child process); empty when unset.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (flag, p) in [
            ("--tls-cert", &self.tls_cert),
            ("--tls-key", &self.tls_key),
            ("--tls-ca", &self.tls_ca),
        ] {
            if let Some(p) = p {
                v.extend([flag.to_string(), p.display().to_string()]);
            }
        }
        v
    }
}

impl MutualTls {
    /// Server side: present our certificate, require one the CA signed from every client.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
    }

    /// Client side, for a server reached at `host`: trust only the CA, present our certificate.
    pub fn client(&self, host: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone())
            .domain_name(host.trim_start_matches('[').trim_end_matches(']'))
    }
}

/// The tonic endpoint for a peer at `addr` (`host:port`, or with an `http://`/`https://`
/// scheme): TLS with `tls`, plain HTTP/2 without.
pub fn endpoint(addr: &str, tls: Option<&MutualTls>) -> Result<Endpoint, String> {
    let addr = addr.trim();
    let hostport = match addr.split_once("://") {
        Some((_, rest)) => rest.trim_end_matches('/'),
        None => addr,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let e = Endpoint::from_shared(format!("{scheme}://{hostport}"))
        .map_err(|e| format!("bad address {addr:?}: {e}"))?;
    match tls {
        None => Ok(e),
        Some(t) => {
            let host = hostport
                .rsplit_once(':')
                .map_or(hostport, |(h, _)| h)
                .to_string();
            e.tls_config(t.client(&host))
                .map_err(|e| format!("TLS for {addr:?}: {e}"))
        }
    }
}
