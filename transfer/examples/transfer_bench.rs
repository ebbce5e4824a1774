//! Loopback transfer benchmark: batches of 1.77 MB extents (one K3 MLA parent plane) from one
//! transport to another, for a few seconds per backend; prints GB/s (10^9 bytes per second,
//! counted at the source once each batch is acknowledged).
//!
//!     cargo run --release -p tessera-transfer [--features ucx] --example transfer_bench -- \
//!         [--seconds 3] [--batch 16] [--extent 1769472] [--conns 4] [--inflight 1] \
//!         [--rotate 4] [--threads 2] [--socket-buffer BYTES|auto] [--processes 1|2] \
//!         [--backend tcp|tcp-nocrc|local|ucx|ucx-crc|raw-tcp] [--ucx-memory ucx|heap] [--tsv]
//!
//! Without `--backend` every backend built in runs (`--only` is an old name of `--backend`).
//! `ucx` (with the `ucx` feature) puts without checksums, as release builds do by default;
//! `ucx-crc` adds the per-extent CRC32C on both sides. Their regions come from
//! `UcxTransport::alloc_region` (shared memory, as a worker using UCX allocates its arena), or
//! with `--ucx-memory heap` from the heap. `--processes 2` puts the destination in a
//! child process, as between two workers of one host (UCX can then use cross-memory attach);
//! `local` always runs in one process. `--tsv` prints one `backend<TAB>GB/s` line per backend
//! instead of the table (for scripts). `raw-tcp` is no transport but context for the TCP rows:
//! the plainest copy loop over loopback, one blocking socket, one `write` per block from the
//! same source group, a receiver in another process reading straight into its destination
//! groups, no checksums and no protocol.
//!
//! As between a prefill and a decode worker, each batch writes pages the previous batches did
//! not: `--inflight` lanes (requests in flight to the peer at once) each own one source group of
//! `--batch` extents (reused, as a prefill worker reuses its source regions) and cycle through
//! `--rotate` destination groups of the destination region (a decode worker's staging slots).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tessera_transfer::checksum::extent_checksum;
#[cfg(feature = "ucx")]
use tessera_transfer::UcxTransport;
use tessera_transfer::{
    Extent, Incarnation, Instant, LocalTransport, PeerId, RegionDescriptor, RegionHandle, RegionId,
    Secret, TcpTransport, TransferId, Transport, TransportConfig, WriteBatch,
};

const BACKENDS: [&str; 6] = ["tcp", "tcp-nocrc", "local", "ucx", "ucx-crc", "raw-tcp"];

struct Args {
    seconds: f64,
    batch: u64,
    extent: u64,
    conns: usize,
    inflight: usize,
    rotate: u64,
    threads: usize,
    socket_buffer: Option<u32>,
    processes: usize,
    backend: Option<String>,
    /// UCX backends: regions from `UcxTransport::alloc_region` (true) or the heap.
    ucx_memory: bool,
    tsv: bool,
    /// Set in the child of `--processes 2`: serve as the destination of this backend.
    target: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        seconds: 3.0,
        batch: 16,
        extent: 1_769_472,
        conns: 4,
        inflight: 1,
        rotate: 4,
        threads: 2,
        socket_buffer: TransportConfig::new(Secret::new("")).socket_buffer_bytes,
        processes: 1,
        backend: None,
        ucx_memory: true,
        tsv: false,
        target: false,
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
            "--rotate" => a.rotate = value().parse::<u64>().expect("rotate").max(1),
            "--threads" => a.threads = value().parse().expect("threads"),
            "--socket-buffer" => {
                a.socket_buffer = match value().as_str() {
                    "auto" => None,
                    v => Some(v.parse().expect("bytes or auto")),
                }
            }
            "--processes" => a.processes = value().parse().expect("1 or 2"),
            "--ucx-memory" => {
                a.ucx_memory = match value().as_str() {
                    "ucx" => true,
                    "heap" => false,
                    v => panic!("--ucx-memory takes ucx or heap, not {v}"),
                }
            }
            "--backend" | "--only" => a.backend = Some(value()),
            "--tsv" => a.tsv = true,
            "--target" => a.target = true,
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(matches!(a.processes, 1 | 2), "--processes takes 1 or 2");
    if let Some(b) = &a.backend {
        assert!(BACKENDS.contains(&b.as_str()), "unknown backend {b}");
        assert!(
            cfg!(feature = "ucx") || !b.starts_with("ucx"),
            "{b}: this build lacks the ucx feature (cargo ... --features ucx)"
        );
    }
    a
}

fn config(args: &Args, backend: &str) -> TransportConfig {
    let mut c = TransportConfig::new(Secret::new("bench"));
    c.checksums = backend != "tcp-nocrc";
    c.rma_checksums = backend == "ucx-crc";
    c.connections_per_peer = args.conns;
    c.socket_buffer_bytes = args.socket_buffer;
    c
}

/// A bound transport and where its regions come from.
struct Bound {
    t: Arc<dyn Transport>,
    alloc: Box<dyn Fn(usize) -> RegionHandle>,
}

async fn bind(args: &Args, backend: &str) -> Bound {
    let c = config(args, backend);
    let heap = || -> Box<dyn Fn(usize) -> RegionHandle> { Box::new(RegionHandle::new) };
    match backend {
        "tcp" | "tcp-nocrc" => Bound {
            t: Arc::new(TcpTransport::bind(c).await.expect("bind tcp")),
            alloc: heap(),
        },
        "local" => Bound {
            t: Arc::new(LocalTransport::new(c)),
            alloc: heap(),
        },
        #[cfg(feature = "ucx")]
        "ucx" | "ucx-crc" => {
            let t = Arc::new(UcxTransport::bind(c).await.expect("bind ucx"));
            let alloc: Box<dyn Fn(usize) -> RegionHandle> = if args.ucx_memory {
                let t = t.clone();
                Box::new(move |len| t.alloc_region(len).expect("ucx allocation"))
            } else {
                heap()
            };
            Bound { t, alloc }
        }
        other => panic!("backend {other} is not built in"),
    }
}

fn pattern(region: &RegionHandle) {
    let mut w = region.try_write(0..region.len()).unwrap();
    for (i, b) in w.iter_mut().enumerate() {
        *b = (i.wrapping_mul(2654435761) >> 13) as u8;
    }
}

/// Writes batches from `src_t` into `desc` for the configured time with `inflight` batches
/// outstanding; returns GB/s. With the destination at hand (one process), each batch also waits
/// for its completion there, and the last batch's bytes are checked.
async fn run(
    args: &Args,
    src_t: &Bound,
    peer: PeerId,
    desc: RegionDescriptor,
    dst: Option<(Arc<dyn Transport>, RegionHandle)>,
) -> f64 {
    let src = (src_t.alloc)(src_len(args));
    pattern(&src);
    let src_t = src_t.t.clone();
    src_t.register(&src).unwrap();
    let dst_t = dst.as_ref().map(|(t, _)| t.clone());
    let next_id = Arc::new(AtomicU64::new(1));
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
        let (batch, extent, rotate) = (args.batch, args.extent, args.rotate);
        workers.push(tokio::spawn(async move {
            let mut moved = 0u64;
            let base = lane * batch * extent;
            let mut k = 0u64;
            while start.elapsed() < run_for {
                let id = TransferId(next_id.fetch_add(1, Ordering::Relaxed));
                let dst_base = (lane * rotate + k % rotate) * batch * extent;
                k += 1;
                let b = WriteBatch {
                    transfer_id: id,
                    dst_region: desc.clone(),
                    // Reversed destination order, as a page table would scatter them.
                    extents: (0..batch)
                        .map(|i| Extent {
                            src_region: src.id(),
                            src_offset: base + i * extent,
                            dst_offset: dst_base + (batch - 1 - i) * extent,
                            len: extent,
                        })
                        .collect(),
                };
                let deadline = Instant::now() + Duration::from_secs(30);
                let r = src_t.write(peer, b, deadline).await.expect("write");
                if let Some(dst_t) = &dst_t {
                    dst_t.wait_incoming(id, deadline).await.expect("completion");
                }
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
    if let Some((_, dst)) = dst {
        // Spot-check the last batch landed where it should.
        let got = dst.try_read(0..args.extent as usize).unwrap();
        let want_at = ((args.batch - 1) * args.extent) as usize;
        let want = src
            .try_read(want_at..want_at + args.extent as usize)
            .unwrap();
        assert!(*got == *want, "destination bytes differ");
    }
    moved as f64 / secs / 1e9
}

/// One source group per lane.
fn src_len(args: &Args) -> usize {
    (args.batch * args.extent) as usize * args.inflight
}

/// `--rotate` destination groups per lane.
fn region_len(args: &Args) -> usize {
    src_len(args) * args.rotate as usize
}

/// Source and destination in this process.
async fn in_process(args: &Args, backend: &str) -> f64 {
    let a = bind(args, backend).await;
    let b = bind(args, backend).await;
    let dst = (b.alloc)(region_len(args));
    let desc = b.t.register(&dst).unwrap();
    let peer =
        a.t.connect(&b.t.endpoint(), Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
    run(args, &a, peer, desc, Some((b.t.clone(), dst))).await
}

/// The destination in a child process (this program with `--target`), which announces its
/// endpoint and region on its first output line and exits when its input closes.
async fn two_processes(args: &Args, backend: &str) -> f64 {
    let me = std::env::current_exe().expect("own path");
    let mut child = Command::new(me)
        .args(std::env::args().skip(1))
        .args(["--target", "--backend", backend])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the destination process");
    let line = announcement(&mut child);
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.len(), 5, "bad announcement {line:?}");
    let desc = RegionDescriptor {
        region_id: RegionId(f[2].parse().unwrap()),
        len: f[3].parse().unwrap(),
        incarnation: Incarnation(u64::from_str_radix(f[4], 16).unwrap()),
        remote_key: Vec::new(),
    };
    let a = bind(args, backend).await;
    let peer =
        a.t.connect(f[1], Instant::now() + Duration::from_secs(5))
            .await
            .unwrap();
    let gbps = run(args, &a, peer, desc, None).await;
    drop(child.stdin.take());
    let _ = child.wait();
    gbps
}

/// The line with which a child (this program with `--target`) announces itself on its output.
/// UCX logs to standard output too: lines before it are skipped.
fn announcement(child: &mut Child) -> String {
    BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map(|l| l.expect("child output"))
        .find(|l| l.starts_with("READY "))
        .expect("the child announces itself")
}

/// The child of `--processes 2`.
async fn serve_target(args: &Args) {
    let backend = args.backend.as_deref().expect("--target needs --backend");
    let b = bind(args, backend).await;
    let dst = (b.alloc)(region_len(args));
    let desc = b.t.register(&dst).unwrap();
    let t = b.t;
    let mut out = std::io::stdout();
    writeln!(
        out,
        "READY {} {} {} {}",
        t.endpoint(),
        desc.region_id.0,
        desc.len,
        desc.incarnation
    )
    .unwrap();
    out.flush().unwrap();
    // Until the parent closes our input.
    tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
    })
    .await
    .unwrap();
}

/// `raw-tcp`: blocks written for the configured time to a child process, over one socket.
fn raw_tcp(args: &Args) -> f64 {
    use std::io::Read;
    let me = std::env::current_exe().expect("own path");
    let mut child = Command::new(me)
        .args(["--target", "--backend", "raw-tcp"])
        .args([
            "--batch",
            &args.batch.to_string(),
            "--extent",
            &args.extent.to_string(),
        ])
        .args(["--rotate", &args.rotate.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the receiving process");
    let line = announcement(&mut child);
    let mut s = std::net::TcpStream::connect(&line[6..]).expect("connect");
    let src = vec![7u8; src_len(args)];
    let block = args.extent as usize;
    let run_for = Duration::from_secs_f64(args.seconds);
    let start = std::time::Instant::now();
    let mut at = 0;
    while start.elapsed() < run_for {
        s.write_all(&src[at..at + block]).expect("write");
        at = (at + block) % src.len();
    }
    s.shutdown(std::net::Shutdown::Write).unwrap();
    // The receiver answers with the bytes it read once it read them all.
    let mut got = [0u8; 8];
    s.read_exact(&mut got).expect("byte count");
    let secs = start.elapsed().as_secs_f64();
    let _ = child.wait();
    u64::from_le_bytes(got) as f64 / secs / 1e9
}

/// The receiving child of `raw-tcp`.
fn raw_tcp_target(args: &Args) {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    println!("READY {}", listener.local_addr().unwrap());
    std::io::stdout().flush().unwrap();
    let (mut s, _) = listener.accept().expect("accept");
    let mut dst = vec![0u8; region_len(args)];
    let (mut at, mut total) = (0usize, 0u64);
    loop {
        let end = (at + args.extent as usize).min(dst.len());
        match s.read(&mut dst[at..end]).expect("read") {
            0 => break,
            n => {
                total += n as u64;
                at = if at + n == dst.len() { 0 } else { at + n };
            }
        }
    }
    s.write_all(&total.to_le_bytes()).expect("byte count");
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
    if args.target && args.backend.as_deref() == Some("raw-tcp") {
        raw_tcp_target(&args);
        return;
    }
    if args.target {
        rt.block_on(serve_target(&args));
        return;
    }
    if !args.tsv {
        println!(
            "transfer_bench: {} extents of {} B per batch ({:.1} MB), {} connection(s), {} batch(es) in flight, {} destination group(s) per lane, socket buffer {}, {} process(es), {} s each, {} cores",
            args.batch,
            args.extent,
            (args.batch * args.extent) as f64 / 1e6,
            args.conns,
            args.inflight,
            args.rotate,
            args.socket_buffer.map_or("auto".to_string(), |b| b.to_string()),
            args.processes,
            args.seconds,
            std::thread::available_parallelism().map_or(0, |n| n.get()),
        );
        println!(
            "crc32c alone (one core):   {:6.2} GB/s",
            crc_rate(args.extent as usize)
        );
    }
    let labels = [
        ("tcp", "tcp, checksums on:"),
        ("tcp-nocrc", "tcp, checksums off:"),
        ("local", "local (memcpy + checksum):"),
        ("ucx", "ucx (RMA put):"),
        ("ucx-crc", "ucx, checksums on:"),
        ("raw-tcp", "raw tcp, one socket:"),
    ];
    for (backend, label) in labels {
        let built = cfg!(feature = "ucx") || !backend.starts_with("ucx");
        let wanted = args.backend.as_deref().is_none_or(|b| b == backend);
        if !built || !wanted {
            continue;
        }
        let gbps = if backend == "raw-tcp" {
            raw_tcp(&args)
        } else if args.processes == 2 && backend != "local" {
            rt.block_on(two_processes(&args, backend))
        } else {
            rt.block_on(in_process(&args, backend))
        };
        if args.tsv {
            println!("{backend}\t{gbps:.2}");
        } else {
            println!("{label:<27}{gbps:6.2} GB/s");
        }
    }
}
