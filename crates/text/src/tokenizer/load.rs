//! Reading `tokenizer.ggml.*` (and `general.name`) from a parsed GGUF file into
//! [`VocabData`], with typed errors naming the file and key.

use super::{Tokenizer, TokenizerError, VocabData};
use sluice_gguf::{GgufFile, MetaValue};

fn type_name(v: &MetaValue) -> String {
    match v {
        MetaValue::Array(a) => format!("array of {:?}", a.elem_type),
        other => format!("{other:?}")
            .split('(')
            .next()
            .unwrap_or("?")
            .to_string(),
    }
}

struct Reader<'a> {
    f: &'a GgufFile,
    file: String,
}

impl Reader<'_> {
    fn wrong(&self, key: &'static str, expected: &'static str, v: &MetaValue) -> TokenizerError {
        TokenizerError::WrongType {
            file: self.file.clone(),
            key,
            expected,
            found: type_name(v),
        }
    }

    fn str_opt(&self, key: &'static str) -> Result<Option<String>, TokenizerError> {
        match self.f.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| self.wrong(key, "string", v)),
        }
    }

    fn u32_opt(&self, key: &'static str) -> Result<Option<u32>, TokenizerError> {
        match self.f.get(key) {
            None => Ok(None),
            // Ids that do not fit u32 are out of range anyway: treat them as absent.
            Some(v) => match v.as_u64() {
                Some(x) => Ok(u32::try_from(x).ok()),
                None if v.as_i64().is_some() => Ok(None),
                None => Err(self.wrong(key, "integer", v)),
            },
        }
    }

    fn bool_opt(&self, key: &'static str) -> Result<Option<bool>, TokenizerError> {
        match self.f.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong(key, "bool", v)),
        }
    }

    fn array(&self, key: &'static str) -> Result<Option<&[MetaValue]>, TokenizerError> {
        match self.f.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_array()
                .map(|a| Some(a.values.as_slice()))
                .ok_or_else(|| self.wrong(key, "array", v)),
        }
    }

    fn strings(&self, key: &'static str) -> Result<Option<Vec<String>>, TokenizerError> {
        let Some(vals) = self.array(key)? else {
            return Ok(None);
        };
        vals.iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.wrong(key, "array of strings", v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let r = Reader {
            f,
            file: f.path.display().to_string(),
        };
        let model =
            r.str_opt("tokenizer.ggml.model")?
                .ok_or_else(|| TokenizerError::MissingKey {
                    file: r.file.clone(),
                    key: "tokenizer.ggml.model",
                })?;
        let tokens =
            r.strings("tokenizer.ggml.tokens")?
                .ok_or_else(|| TokenizerError::MissingKey {
                    file: r.file.clone(),
                    key: "tokenizer.ggml.tokens",
                })?;
        let scores = match r.array("tokenizer.ggml.scores")? {
            None => None,
            Some(vals) => Some(
                vals.iter()
                    .map(|v| {
                        v.as_f32()
                            .or_else(|| v.as_i64().map(|i| i as f32))
                            .ok_or_else(|| r.wrong("tokenizer.ggml.scores", "array of f32", v))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let token_types = match r.array("tokenizer.ggml.token_type")? {
            None => None,
            Some(vals) => Some(
                vals.iter()
                    .map(|v| {
                        v.as_i64()
                            .map(|i| i32::try_from(i).unwrap_or(0))
                            .ok_or_else(|| r.wrong("tokenizer.ggml.token_type", "array of i32", v))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let data = VocabData {
            pre: r.str_opt("tokenizer.ggml.pre")?,
            merges: r.strings("tokenizer.ggml.merges")?.unwrap_or_default(),
            tokens,
            scores,
            token_types,
            bos: r.u32_opt("tokenizer.ggml.bos_token_id")?,
            eos: r.u32_opt("tokenizer.ggml.eos_token_id")?,
            eot: r.u32_opt("tokenizer.ggml.eot_token_id")?,
            eom: r.u32_opt("tokenizer.ggml.eom_token_id")?,
            unk: r.u32_opt("tokenizer.ggml.unknown_token_id")?,
            sep: r.u32_opt("tokenizer.ggml.seperator_token_id")?,
            pad: r.u32_opt("tokenizer.ggml.padding_token_id")?,
            add_bos: r.bool_opt("tokenizer.ggml.add_bos_token")?,
            add_eos: r.bool_opt("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: r.bool_opt("tokenizer.ggml.add_space_prefix")?,
            name: r.str_opt("general.name")?,
            model,
        };
        if data.model.is_empty() {
            return Err(TokenizerError::UnsupportedModel {
                file: r.file,
                model: String::new(),
            });
        }
        Tokenizer::from_vocab(data, &r.file)
    }
}
