//! The cost of constrained decoding per token: llguidance's mask for a non-trivial JSON
//! schema over a real model's vocabulary, timed token by token while valid answers are fed
//! through it (the tokens of JSON instances of the schema, as the model's tokenizer
//! writes them). Prints the trie build time and the median / p99 / max of the per-token
//! mask time (mask computation plus setting forbidden logits to -inf).
//!
//!   cargo run --release -p sluice-server --example mask_cost -- MODEL.gguf

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use sluice_engine::text::tokenizer::Tokenizer;
use sluice_server::constrain::{Constrainer, Spec};

fn main() -> Result<(), String> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: mask_cost MODEL.gguf")?;
    let model = sluice_engine::models::Model::load(std::path::Path::new(&path))
        .map_err(|e| e.to_string())?;
    let tok = Arc::new(Tokenizer::from_gguf(&model.gguf).map_err(|e| e.to_string())?);
    let n = model.cfg.n_vocab;
    let t0 = Instant::now();
    let c = Constrainer::new(tok.clone(), n)?;
    let build = t0.elapsed().as_secs_f64();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": false},
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": false,
    });
    let names = [
        "Ada Lovelace",
        "Alan",
        "Grace Hopper",
        "Édith Piaf",
        "李白",
        "Bob",
    ];
    let cities = ["Paris", "London", "New York", "Zürich", "Tokyo"];
    // The first mask of an answer (no lexer state cached yet) apart from the rest.
    let (mut first, mut secs) = (Vec::new(), Vec::new());
    let t1 = Instant::now();
    let mut compiles = 0.0;
    for i in 0..30 {
        let tags = ["a", "b", "c"][..i % 4].to_vec();
        let inst = json!({
            "name": names[i % names.len()],
            "age": (i * 7) % 120,
            "tags": tags,
            "address": {"city": cities[i % cities.len()], "zip": format!("{:05}", i * 1234 % 100000)},
        });
        let text = serde_json::to_string(&inst).map_err(|e| e.to_string())?;
        let tc = Instant::now();
        let mut jc = c.compile(&Spec::JsonSchema(schema.clone()))?;
        compiles += tc.elapsed().as_secs_f64();
        let mut logits = vec![0f32; n];
        for id in tok.encode(&text, false, false) {
            logits.iter_mut().for_each(|l| *l = 0.0);
            jc.apply(&mut logits)?;
            if logits[id as usize] == f32::NEG_INFINITY {
                return Err(format!("token {id} of {text} was masked"));
            }
            jc.commit(id)?;
        }
        if !jc.done() {
            return Err(format!("the grammar did not end after {text}"));
        }
        first.push(jc.mask_secs[0]);
        secs.extend_from_slice(&jc.mask_secs[1..]);
    }
    let wall = t1.elapsed().as_secs_f64();
    let q = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize] * 1e6
    };
    println!(
        "vocab {n}: trie + factory {:.0} ms; schema compile {:.2} ms avg; {} masked tokens after the first: median {:.1} us, p99 {:.1} us, max {:.1} us; first mask of each of the {} answers: median {:.1} us, max {:.1} us ({:.1} s total)",
        build * 1e3,
        compiles / 30.0 * 1e3,
        secs.len(),
        q(&mut secs, 0.5),
        q(&mut secs, 0.99),
        q(&mut secs, 1.0),
        first.len(),
        q(&mut first, 0.5),
        q(&mut first, 1.0),
        wall
    );
    Ok(())
}
