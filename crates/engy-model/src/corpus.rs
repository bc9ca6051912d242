//! The small English corpus the devnet tokenizer is trained on and the model's bigram prior is
//! counted from, generated from the seed (no files shipped, nothing downloaded).
//!
//! Each document is one ChatML exchange (`<|im_start|>user … <|im_end|>` then an assistant turn
//! of several sentences), so the counted statistics include how an assistant turn starts after
//! `<|im_start|>assistant\n` and how it ends with `<|im_end|>`.
use crate::rng::SplitMix64;

const SUBJECTS: &[&str] = &[
    "the miner",
    "the validator",
    "the gateway",
    "a buyer",
    "the serve",
    "the auditor",
    "each worker",
    "the network",
    "the subnet",
    "every proof",
    "the model",
    "the chain",
    "a small model",
    "the provider",
    "the operator",
    "this request",
];
const VERBS: &[&str] = &[
    "checks", "sends", "signs", "verifies", "streams", "computes", "stores", "reads", "records",
    "routes", "returns", "measures", "keeps", "rejects", "accepts", "writes",
];
const OBJECTS: &[&str] = &[
    "the hidden states",
    "a new epoch",
    "the weight vector",
    "every token",
    "the commitment",
    "a short answer",
    "the top values",
    "the final layer",
    "the proof bytes",
    "the chat template",
    "a long completion",
    "the model root",
    "the first chunk",
    "the signed payload",
    "each decode batch",
    "the reward",
];
const ADVERBS: &[&str] = &[
    "quickly",
    "again",
    "on time",
    "in order",
    "without a cache",
    "for the buyer",
    "on every block",
    "before the deadline",
    "with care",
    "at once",
    "in one pass",
    "step by step",
];
const CONNECTORS: &[&str] = &[
    "then",
    "so",
    "because",
    "while",
    "and later",
    "but first",
    "after that",
    "which means",
];
const QUESTIONS: &[&str] = &[
    "what does the miner do",
    "how is a proof checked",
    "why does the validator wait",
    "who signs the weight vector",
    "what happens when a serve cheats",
    "how long is an epoch",
    "where do the hidden states go",
    "tell me about the gateway",
    "explain the audit",
    "write a short story about a proof",
    "what is a decode batch",
    "how are tokens streamed",
];

fn pick<'a>(rng: &mut SplitMix64, words: &[&'a str]) -> &'a str {
    words.get(rng.below(words.len())).copied().unwrap_or("the")
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// One sentence: subject, verb, object, optionally an adverb and a connected clause.
fn sentence(rng: &mut SplitMix64) -> String {
    let mut s = format!(
        "{} {} {}",
        capitalise(pick(rng, SUBJECTS)),
        pick(rng, VERBS),
        pick(rng, OBJECTS)
    );
    if rng.below(2) == 0 {
        s.push(' ');
        s.push_str(pick(rng, ADVERBS));
    }
    if rng.below(3) == 0 {
        s.push_str(", ");
        s.push_str(pick(rng, CONNECTORS));
        s.push(' ');
        s.push_str(pick(rng, SUBJECTS));
        s.push(' ');
        s.push_str(pick(rng, VERBS));
        s.push(' ');
        s.push_str(pick(rng, OBJECTS));
    }
    s.push(if rng.below(8) == 0 { '!' } else { '.' });
    s
}

/// The assistant text of one exchange: `4..=12` sentences.
fn answer(rng: &mut SplitMix64) -> String {
    let n = 4 + rng.below(9);
    (0..n).map(|_| sentence(rng)).collect::<Vec<_>>().join(" ")
}

/// `n_docs` ChatML documents, deterministic in `seed`. Each is
/// `<|im_start|>user\n{question}?<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n`.
pub fn chat_documents(seed: u64, n_docs: usize) -> Vec<String> {
    let mut rng = SplitMix64::for_label(seed, "corpus");
    (0..n_docs)
        .map(|_| {
            let q = capitalise(pick(&mut rng, QUESTIONS));
            let a = answer(&mut rng);
            format!("<|im_start|>user\n{q}?<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n")
        })
        .collect()
}

/// Example user prompts in the corpus' style (for tests and the devnet requests).
pub fn sample_prompts(seed: u64, n: usize) -> Vec<String> {
    let mut rng = SplitMix64::for_label(seed, "prompts");
    (0..n)
        .map(|i| {
            let q = capitalise(pick(&mut rng, QUESTIONS));
            if i % 3 == 2 {
                format!("{q}? {}", sentence(&mut rng))
            } else {
                format!("{q}?")
            }
        })
        .collect()
}
