//! Recorded-shape sglang `/generate` replies for the ingest benches and the `ingest_bench`
//! example (sglang-native-api.md §2.2, §2.3, §2.7, §8).
//!
//! Hidden values are bf16-exact and printed as orjson prints Python floats (shortest
//! round-trip decimal of the f64, e.g. `-0.1640625`, `0.0439453125`, `1.0`), drawn from a
//! roughly normal distribution (σ ≈ 1) with rare ±16..64 outliers, like post-norm states.
//! Element 0 is the 1-row prefill block of engy's serve hook (§8); elements ≥ 1 are 1-D
//! rows. Rows are taken round-robin from a pool of 97 distinct rows, so a 4,096-token body
//! is produced without ever being held whole (the [`Body`] chunk iterator copies pool text
//! into fixed-size chunks, as bytes arrive from a socket).
#![allow(dead_code)]

use engy_core::toploc::{bf16_bits_to_f32, f32_to_bf16_bits};

/// Distinct rows in the pool.
const POOL: usize = 97;

/// A deterministic reply of `tokens` output tokens × `hidden` floats.
pub struct Reply {
    head: Vec<u8>,
    rows: Vec<Vec<u8>>,
    tail: Vec<u8>,
    tokens: usize,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // SplitMix64.
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let u = self.unit().max(1e-12);
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

fn push_f64(out: &mut Vec<u8>, v: f64) {
    // serde_json prints the shortest round-trip decimal (ryu), as orjson does.
    let _ = serde_json::to_writer(&mut *out, &v);
}

fn row_text(rng: &mut Rng, hidden: usize) -> Vec<u8> {
    let mut s = Vec::with_capacity(hidden * 12);
    s.push(b'[');
    for j in 0..hidden {
        if j > 0 {
            s.push(b',');
        }
        let mut x = rng.normal();
        if rng.next().is_multiple_of(512) {
            x *= 16.0 + (rng.next() % 48) as f64;
        }
        let b = f32_to_bf16_bits(x as f32);
        push_f64(&mut s, f64::from(bf16_bits_to_f32(b)));
    }
    s.push(b']');
    s
}

impl Reply {
    /// Build the parts of a reply. `stream`: the final SSE event (`data: {…}\n\n`
    /// followed by `data: [DONE]\n\n`) instead of a non-stream body.
    pub fn new(tokens: usize, hidden: usize, stream: bool) -> Self {
        let mut rng = Rng(0x5eed ^ (hidden as u64) << 20 ^ tokens as u64);
        let rows: Vec<Vec<u8>> = (0..POOL.min(tokens.max(1)))
            .map(|_| row_text(&mut rng, hidden))
            .collect();
        let mut head = Vec::new();
        if stream {
            head.extend_from_slice(b"data: ");
        }
        head.extend_from_slice(b"{\"text\":\"");
        for i in 0..tokens {
            head.extend_from_slice([" the", " sky", " is", " blue", ",", " and"][i % 6].as_bytes());
        }
        head.extend_from_slice(b"\",\"output_ids\":[");
        let ids: Vec<u32> = (0..tokens)
            .map(|i| 100 + (i as u32 * 7919) % 150_000)
            .collect();
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                head.push(b',');
            }
            head.extend_from_slice(id.to_string().as_bytes());
        }
        head.extend_from_slice(b"],\"meta_info\":{\"id\":\"engy-0123456789abcdef0123456789abcdef\",\"finish_reason\":{\"type\":\"length\",\"length\":");
        head.extend_from_slice(tokens.to_string().as_bytes());
        head.extend_from_slice(b"},\"prompt_tokens\":812,\"weight_version\":\"default\",\"num_retractions\":0,\"input_token_logprobs\":[],\"output_token_logprobs\":[");
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                head.push(b',');
            }
            head.push(b'[');
            push_f64(&mut head, f64::from(-(rng.unit() as f32) * 3.0));
            head.push(b',');
            head.extend_from_slice(id.to_string().as_bytes());
            head.extend_from_slice(b",null]");
        }
        head.extend_from_slice(b"],\"output_token_logprobs_length\":");
        head.extend_from_slice(tokens.to_string().as_bytes());
        head.extend_from_slice(b",\"reasoning_tokens\":0,\"completion_tokens\":");
        head.extend_from_slice(tokens.to_string().as_bytes());
        head.extend_from_slice(
            b",\"cached_tokens\":0,\"cached_tokens_details\":null,\"hidden_states\":[",
        );
        let mut tail = Vec::new();
        tail.extend_from_slice(b",\"dp_rank\":null,\"e2e_latency\":41.28125");
        if !stream {
            tail.extend_from_slice(b",\"response_sent_to_client_ts\":1769990400.125");
        }
        tail.extend_from_slice(b"}}");
        if stream {
            tail.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        }
        Self {
            head,
            rows,
            tail,
            tokens,
        }
    }

    /// Total size in bytes.
    pub fn len(&self) -> usize {
        (0..self.n_pieces())
            .filter_map(|k| self.piece(k))
            .map(<[u8]>::len)
            .sum()
    }

    fn row(&self, i: usize) -> &[u8] {
        self.rows
            .get(i % self.rows.len().max(1))
            .map(Vec::as_slice)
            .unwrap_or(b"[]")
    }

    fn n_pieces(&self) -> usize {
        2 * self.tokens + 3
    }

    /// Piece `k` of the reply: head, then (separator, row) per element, the closing
    /// bracket(s), the tail.
    fn piece(&self, k: usize) -> Option<&[u8]> {
        let t = self.tokens;
        if k == 0 {
            return Some(&self.head);
        }
        if k <= 2 * t {
            let i = (k - 1) / 2;
            if (k - 1) % 2 == 1 {
                return Some(self.row(i));
            }
            return Some(match i {
                0 => b"[",
                1 => b"],",
                _ => b",",
            });
        }
        if k == 2 * t + 1 {
            return Some(match t {
                0 => b"",
                1 => b"]]",
                _ => b"]",
            });
        }
        if k == 2 * t + 2 {
            return Some(&self.tail);
        }
        None
    }

    /// The whole reply in one buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        let mut c = self.chunks(usize::MAX);
        while c.fill(&mut v) {}
        v
    }

    /// The reply as a sequence of chunks of at most `chunk` bytes, generated on demand.
    pub fn chunks(&self, chunk: usize) -> Chunks<'_> {
        Chunks {
            reply: self,
            k: 0,
            off: 0,
            chunk: chunk.max(1),
        }
    }
}

/// Chunks of a [`Reply`], copied from the row pool as they are asked for.
pub struct Chunks<'a> {
    reply: &'a Reply,
    k: usize,
    off: usize,
    chunk: usize,
}

impl Chunks<'_> {
    /// Append the next chunk (≤ `chunk` bytes) to `buf`; false when the reply is done.
    pub fn fill(&mut self, buf: &mut Vec<u8>) -> bool {
        let mut room = self.chunk;
        let mut any = false;
        while room > 0 {
            let Some(p) = self.reply.piece(self.k) else {
                return any;
            };
            let rest = p.get(self.off..).unwrap_or(&[]);
            let take = rest.len().min(room);
            buf.extend_from_slice(rest.get(..take).unwrap_or(&[]));
            any |= take > 0;
            room -= take;
            self.off += take;
            if self.off >= p.len() {
                self.k += 1;
                self.off = 0;
            }
        }
        true
    }
}

/// CPU time of the calling thread, seconds (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// User + system CPU time of the whole process, seconds (`getrusage(RUSAGE_SELF)`).
pub fn process_cpu_s() -> f64 {
    // SAFETY: rusage is plain data; getrusage fills it through a valid pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// A criterion measurement of the bench thread's CPU time (not wall time: the machine is
/// shared, and waiting for a core is not the code's cost).
pub struct CpuTime;

static WALL: criterion::measurement::WallTime = criterion::measurement::WallTime;

impl criterion::measurement::Measurement for CpuTime {
    type Intermediate = f64;
    type Value = f64;

    fn start(&self) -> f64 {
        thread_cpu_s()
    }
    fn end(&self, start: f64) -> f64 {
        (thread_cpu_s() - start) * 1e9
    }
    fn add(&self, a: &f64, b: &f64) -> f64 {
        a + b
    }
    fn zero(&self) -> f64 {
        0.0
    }
    fn to_f64(&self, v: &f64) -> f64 {
        *v
    }
    fn formatter(&self) -> &dyn criterion::measurement::ValueFormatter {
        // Values are nanoseconds, as WallTime's.
        criterion::measurement::Measurement::formatter(&WALL)
    }
}
