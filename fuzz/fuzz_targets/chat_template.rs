//! Arbitrary chat input rendered by the chat templates: the Kimi template the tiny model ships
//! and a Hugging Face–style template leaning on the Python-compatible methods and `tojson`.
//! The input is JSON `{"messages": [...], ...extra template variables}` (or a bare message
//! list); anything else becomes one message whose role is picked by the first byte and whose
//! content is the rest. Rendering must return text or an error, never panic; rendered text must
//! survive a tokenizer round trip.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};
use tessera_tokenizer::{ChatMessage, ChatTemplate, Tokenizer, KIMI_CHAT_TEMPLATE};

const HF_STYLE: &str = "{{ bos_token }}\
{% for m in messages %}\
{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' ~ m.role) }}{% endif %}\
[{{ m.role | upper }}{% if m.get('name') %}:{{ m.get('name').strip() }}{% endif %}] \
{% if m.content is string %}{{ m.content.strip() }}\
{% elif m.content is none %}-\
{% else %}{{ m.content | tojson(indent=2, sort_keys=true) }}{% endif %}\
{% if m.tool_calls %}{{ m.tool_calls | tojson(separators=(',', ':'), ensure_ascii=true) }}{% endif %}\
{% for k, v in m.items() %}{% if k.startswith('x') %}{{ k }}={{ v | tojson }}{% endif %}{% endfor %}\
{{ eos_token }}\n\
{% endfor %}\
{% if tools %}{{ tools | tojson(indent='\\t') }}{% endif %}\
{% if add_generation_prompt %}[ASSISTANT] {% endif %}";

const ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "wizard"];

struct Setup {
    tokenizer: Tokenizer,
    templates: Vec<ChatTemplate>,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        tessera_tokenizer::write_tiny_tokenizer(dir.path(), 1024).expect("tiny tokenizer");
        let tokenizer = Tokenizer::from_dir(dir.path()).expect("tokenizer");
        let shipped = ChatTemplate::from_dir(dir.path())
            .expect("chat template")
            .expect("the tiny tokenizer has a chat template");
        let templates = vec![
            shipped,
            ChatTemplate::new(KIMI_CHAT_TEMPLATE).expect("Kimi template"),
            ChatTemplate::new(HF_STYLE)
                .expect("HF-style template")
                .with_token("bos_token", "<s>")
                .with_token("eos_token", "</s>"),
        ];
        Setup {
            tokenizer,
            templates,
        }
    })
}

/// The messages and extra variables `data` stands for.
fn chat(data: &[u8]) -> (Vec<ChatMessage>, Map<String, Value>) {
    match serde_json::from_slice::<Value>(data) {
        Ok(Value::Object(mut vars)) => {
            let messages = vars
                .remove("messages")
                .and_then(|m| serde_json::from_value(m).ok())
                .unwrap_or_default();
            (messages, vars)
        }
        Ok(list @ Value::Array(_)) => {
            (serde_json::from_value(list).unwrap_or_default(), Map::new())
        }
        _ => {
            let (&first, rest) = data.split_first().unwrap_or((&0, &[]));
            let role = ROLES[first as usize % ROLES.len()];
            let content = String::from_utf8_lossy(rest).into_owned();
            (vec![ChatMessage::new(role, content)], Map::new())
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let setup = setup();
    let (messages, vars) = chat(data);
    for template in &setup.templates {
        for add_generation_prompt in [true, false] {
            let Ok(text) = template.render_with(&messages, add_generation_prompt, &vars) else {
                continue;
            };
            let ids = setup
                .tokenizer
                .encode(&text, true)
                .unwrap_or_else(|e| panic!("cannot tokenize a rendered chat ({e}): {text:?}"));
            let back = setup
                .tokenizer
                .decode(&ids, false)
                .unwrap_or_else(|e| panic!("cannot detokenize {ids:?} ({e})"));
            assert_eq!(
                back, text,
                "the tokenizer does not round-trip the rendered chat"
            );
        }
    }
});
