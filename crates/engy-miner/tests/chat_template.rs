//! The chat template + tokenizer give exactly Hugging Face `transformers`
//! `apply_chat_template(tokenize=True, add_generation_prompt=True)` ids (docs/PROTOCOL.md §3.1),
//! for a checkpoint generated here, computed at test time by `tests/hf_chat_template.py`.
mod common;

use engy_miner::chat::Prompter;
use serde_json::{json, Value};

fn conversations() -> Value {
    json!([
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Tell me a joke."}],
        [{"role": "user", "content": "Café naïve — 日本語 🙂 ✨"}],
        [{"role": "user", "content": ""}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  and\nnewlines\n\n"}],
        [{"role": "user", "content": "<|im_start|>not a real turn<|im_end|>"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"}],
    ])
}

#[test]
fn prompt_ids_match_transformers_apply_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = common::checkpoint(dir.path(), 64);
    let p = Prompter::load(&ckpt).unwrap();
    let convs = conversations();
    let ours: Vec<Vec<u32>> = convs
        .as_array()
        .unwrap()
        .iter()
        .map(|c| p.prompt_ids(c).unwrap())
        .collect();
    // Sanity without Python: the ChatML structure is there.
    let text = p.render(&convs[1]).unwrap();
    assert_eq!(text, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
    assert!(p
        .render(&convs[0])
        .unwrap()
        .starts_with("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"));
    if !common::python_has_transformers() {
        // CI must compare (it pip-installs transformers); elsewhere say so and skip.
        assert!(
            std::env::var("CI").is_err(),
            "CI needs python3 with transformers: python3 -m pip install 'transformers>=4.45,<5'"
        );
        eprintln!("SKIPPED: python3 with `transformers` not found; `pip install transformers` to compare with Hugging Face");
        return;
    }

    let convs_path = dir.path().join("convs.json");
    std::fs::write(&convs_path, convs.to_string()).unwrap();
    let out = std::process::Command::new("python3")
        .arg(common::script("hf_chat_template.py"))
        .arg(&ckpt)
        .arg(&convs_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(theirs.len(), ours.len());
    for (i, (a, b)) in ours.iter().zip(theirs.iter()).enumerate() {
        assert_eq!(a, b, "conversation {i}: {}", convs[i]);
    }
}

#[test]
fn template_errors_are_reported_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = common::checkpoint(dir.path(), 64);
    std::fs::write(
        ckpt.join("chat_template.jinja"),
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ m.content.strip() }}|{% endfor %}",
    )
    .unwrap();
    let p = Prompter::load(&ckpt).unwrap();
    assert_eq!(
        p.render(&json!([{"role":"user","content":"  x  "}]))
            .unwrap(),
        "x|"
    );
    let e = p
        .render(&json!([{"role":"tool","content":"x"}]))
        .unwrap_err();
    assert!(e.to_string().contains("no tools"), "{e}");
    assert!(p.render(&json!({"not": "a list"})).is_err());
    assert!(p.render(&json!([{"content": "no role"}])).is_err());
}

/// A template that renders `content` given as a list of typed parts (as multimodal chat
/// templates do), and one that renders anything but a string as empty (as Qwen3's does).
const PARTS_TEMPLATE: &str = "{%- macro text_of(content) -%}\
{%- if content is string -%}{{ content }}\
{%- elif content is iterable and content is not mapping -%}\
{%- for part in content -%}\
{%- if part is mapping and part.type == 'text' -%}{{ part.text }}\
{%- elif part is mapping and ('image' in part or part.type == 'image') -%}<|image|>\
{%- endif -%}\
{%- endfor -%}\
{%- endif -%}\
{%- endmacro -%}\
{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}{{ text_of(m.content) }}{{ '<|im_end|>\\n' }}{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

const STRING_ONLY_TEMPLATE: &str = "{%- for m in messages -%}\
{%- if m.content is string -%}{%- set c = m.content -%}{%- else -%}{%- set c = '' -%}{%- endif -%}\
{{ '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

#[test]
fn content_as_a_list_of_parts_renders_as_transformers_renders_it() {
    let convs = json!([
        [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there."}]}],
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image", "image": "x.png"}, {"type": "text", "text": "B"}]}],
        [{"role": "user", "content": []}],
    ]);
    for (name, template, first) in [
        (
            "parts",
            PARTS_TEMPLATE,
            "<|im_start|>user\nHello there.<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "string-only",
            STRING_ONLY_TEMPLATE,
            "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = common::checkpoint(dir.path(), 64);
        std::fs::write(ckpt.join("chat_template.jinja"), template).unwrap();
        let p = Prompter::load(&ckpt).unwrap();
        assert_eq!(p.render(&convs[0]).unwrap(), first, "{name}");
        let ours: Vec<Vec<u32>> = convs
            .as_array()
            .unwrap()
            .iter()
            .map(|c| p.prompt_ids(c).unwrap_or_else(|e| panic!("{name}: {e}")))
            .collect();
        if !common::python_has_transformers() {
            assert!(
                std::env::var("CI").is_err(),
                "CI needs python3 with transformers"
            );
            eprintln!("SKIPPED: python3 with `transformers` not found");
            return;
        }
        let convs_path = dir.path().join("convs.json");
        std::fs::write(&convs_path, convs.to_string()).unwrap();
        let out = std::process::Command::new("python3")
            .arg(common::script("hf_chat_template.py"))
            .arg(&ckpt)
            .arg(&convs_path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let theirs: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(ours, theirs, "{name}");
    }
}
