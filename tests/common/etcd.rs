//! A throwaway single-member etcd on loopback for discovery tests (DESIGN §8: "a real etcd for
//! discovery tests"). The `etcd` binary comes from Debian's `etcd-server`, which
//! `scripts/test.sh` installs. Shared by the root crate's tests and `router/tests` (included
//! there with `#[path]`).

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_proto::etcd::EtcdClient;

/// The `etcd` binary, or a failure that says how to get it (never a skip).
pub fn etcd_binary() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    });
    found
        .or_else(|| {
            let p = PathBuf::from("/usr/bin/etcd");
            p.is_file().then_some(p)
        })
        .expect(
            "`etcd` is not installed: run scripts/test.sh (it installs the Debian package \
             `etcd-server`), or `apt-get install -y etcd-server`",
        )
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A single-member etcd on loopback, killed on drop.
pub struct Etcd {
    child: Child,
    /// `127.0.0.1:<client port>`, what `--etcd` takes.
    pub endpoint: String,
    dir: tempfile::TempDir,
}

impl Etcd {
    /// What etcd logged so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts etcd and returns once it answers a range request (at most 20 s).
pub async fn start_etcd() -> Etcd {
    let bin = etcd_binary();
    let dir = tempfile::tempdir().unwrap();
    let (client, peer) = (free_port(), free_port());
    let curl = format!("http://127.0.0.1:{client}");
    let purl = format!("http://127.0.0.1:{peer}");
    let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
    let child = Command::new(&bin)
        .args(["--name", "t", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--listen-client-urls", &curl])
        .args(["--advertise-client-urls", &curl])
        .args(["--listen-peer-urls", &purl])
        .args(["--initial-advertise-peer-urls", &purl])
        .args(["--initial-cluster", &format!("t={purl}")])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let etcd = Etcd {
        child,
        endpoint: format!("127.0.0.1:{client}"),
        dir,
    };
    let c = EtcdClient::connect_lazy(std::slice::from_ref(&etcd.endpoint), Duration::from_secs(1))
        .unwrap();
    let t0 = Instant::now();
    while c.get_prefix("/").await.is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "etcd did not answer within 20 s; log: {}",
            etcd.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    etcd
}
