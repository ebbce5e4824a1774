//! Loopback transfer benchmark: batches of 1.77 MB extents (one K3 MLA parent plane) from one
//! transport to another in the same process, for a few seconds per configuration; prints GB/s
//! (10^9 bytes per second, counted at the source once each batch is acknowledged).
//!
//!     cargo run --release -p tessera-transfer --example transfer_bench -- \
//!         [--seconds 3] [--batch 16] [--extent 1769472] [--conns 4] [--inflight 1] \
//!         [--threads 2] [--socket-buffer BYTES|auto] [--only tcp|tcp-nocrc|local]

use std::sync::Arc;
use std::time::Duration;

use tessera_transfer::checksum::extent_checksum;
use tessera_transfer::{
    Extent, Instant, LocalTransport, PeerId, RegionHandle, Secret, TcpTransport, TransferId,
    Transport, TransportConfig, WriteBatch,
};

struct Args {
    seconds: f64,
    batch: u64,
    extent: u64,
    conns: usize,
    inflight: usize,
    threads: usize,
    socket_buffer: Option<u32>,
    only: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        seconds: 3.0,
        batch: 16,
        extent: 1_769_472,
        conns: 4,
        inflight: 1,
        threads: 2,
        socket_buffer: TransportConfig::new(Secret::new("")).socket_buffer_bytes,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--seconds" => a.seconds = value().parse().expect("seconds"),
            "--batch" => a.batch = value().parse().expect("batch"),
            "--extent" => a.extent = value().parse().expect("extent"),
            "--conns" => a.conns = value().parse().expect("conns"),
            "--inflight" => a.inflight = value().parse().expect("inflight"),
            "--threads" => a.threads = value().parse().expect("threads"),
            "--socket-buffer" => {
                a.socket_buffer = match value().as_str() {
                    "auto" => None,
                    v => Some(v.parse().expect("bytes or auto")),
                }
            }
            "--only" => a.only = Some(value()),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn config(args: &Args, checksums: bool) -> TransportConfig {
    let mut c = TransportConfig::new(Secret::new("bench"));
    c.checksums = checksums;
    c.connections_per_peer = args.conns;
    c.socket_buffer_bytes = args.socket_buffer;
    c
}

/// Writes batches from `src` to `dst` for the configured time with `inflight` batches
/// outstanding; returns GB/s.
async fn run(
    args: &Args,
    src_t: Arc<dyn Transport>,
    dst_t: Arc<dyn Transport>,
    peer: PeerId,
) -> f64 {
    let bytes = (args.batch * args.extent) as usize;
    let src = RegionHandle::new(bytes * args.inflight);
    {
        let mut w = src.try_write(0..src.len()).unwrap();
        for (i, b) in w.iter_mut().enumerate() {
            *b = (i.wrapping_mul(2654435761) >> 13) as u8;
        }
    }
    src_t.register(&src).unwrap();
    let dst = RegionHandle::new(bytes * args.inflight);
    let desc = dst_t.register(&dst).unwrap();
    let next_id = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let run_for = Duration::from_secs_f64(args.seconds);
    let start = Instant::now();
    let mut workers = Vec::new();
    for lane in 0..args.inflight as u64 {
        let (src_t, dst_t, src, desc, next_id) = (
            src_t.clone(),
            dst_t.clone(),
            src.clone(),
            desc.clone(),
            next_id.clone(),
        );
        let (batch, extent) = (args.batch, args.extent);
        workers.push(tokio::spawn(async move {
            let mut moved = 0u64;
            let base = lane * batch * extent;
            while start.elapsed() < run_for {
                let id = TransferId(next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
                let b = WriteBatch {
                    transfer_id: id,
                    dst_region: desc.clone(),
                    // Reversed destination order, as a page table would scatter them.
                    extents: (0..batch)
                        .map(|i| Extent {
                            src_region: src.id(),
                            src_offset: base + i * extent,
                            dst_offset: base + (batch - 1 - i) * extent,
                            len: extent,
                        })
                        .collect(),
                };
                let deadline = Instant::now() + Duration::from_secs(30);
                let r = src_t.write(peer, b, deadline).await.expect("write");
                dst_t.wait_incoming(id, deadline).await.expect("completion");
                moved += r.bytes;
            }
            moved
        }));
    }
    let mut moved = 0;
    for w in workers {
        moved += w.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    // Spot-check the last batch landed where it should.
    let got = dst.try_read(0..args.extent as usize).unwrap();
    let want_at = ((args.batch - 1) * args.extent) as usize;
    let want = src
        .try_read(want_at..want_at + args.extent as usize)
        .unwrap();
    assert!(*got == *want, "destination bytes differ");
    moved as f64 / secs / 1e9
}

async fn tcp(args: &Args, checksums: bool) -> f64 {
    let a = TcpTransport::bind(config(args, checksums)).await.unwrap();
    let b = TcpTransport::bind(config(args, checksums)).await.unwrap();
    let peer = a
        .connect(&b.endpoint(), Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    run(args, Arc::new(a), Arc::new(b), peer).await
}

async fn local(args: &Args) -> f64 {
    let a = LocalTransport::new(config(args, true));
    let b = LocalTransport::new(config(args, true));
    let peer = a
        .connect(&b.endpoint(), Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    run(args, Arc::new(a), Arc::new(b), peer).await
}

fn crc_rate(extent: usize) -> f64 {
    let buf: Vec<u8> = (0..extent).map(|i| (i * 31) as u8).collect();
    let start = Instant::now();
    let mut n = 0u64;
    let mut acc = 0u32;
    while start.elapsed() < Duration::from_millis(500) {
        acc ^= extent_checksum(&buf);
        n += 1;
    }
    std::hint::black_box(acc);
    (n * extent as u64) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let args = parse_args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "transfer_bench: {} extents of {} B per batch ({:.1} MB), {} connection(s), {} batch(es) in flight, socket buffer {}, {} s each, {} cores",
        args.batch,
        args.extent,
        (args.batch * args.extent) as f64 / 1e6,
        args.conns,
        args.inflight,
        args.socket_buffer.map_or("auto".to_string(), |b| b.to_string()),
        args.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    println!(
        "crc32c alone (one core):   {:6.2} GB/s",
        crc_rate(args.extent as usize)
    );
    let want = |name: &str| args.only.as_deref().is_none_or(|o| o == name);
    if want("tcp") {
        println!(
            "tcp, checksums on:         {:6.2} GB/s",
            rt.block_on(tcp(&args, true))
        );
    }
    if want("tcp-nocrc") {
        println!(
            "tcp, checksums off:        {:6.2} GB/s",
            rt.block_on(tcp(&args, false))
        );
    }
    if want("local") {
        println!(
            "local (memcpy + checksum): {:6.2} GB/s",
            rt.block_on(local(&args))
        );
    }
}
