//! Structured outputs: grammar constraints compiled by the llguidance engine,
//! and the token mask each constrained sampling row gets.
//!
//! * A [`Vocabulary`] is built once per tokenizer: the byte string of every
//!   token and the tokenizer itself (from `tokenizer.json`, through the HF
//!   tokenizers library, so text a grammar forces is tokenized canonically),
//!   its token trie, and the parser factory that compiles grammars against
//!   it. A process shares one per (tokenizer, EOS ids, logits) while anyone
//!   holds it.
//! * A [`Constraint`] (JSON schema, JSON object, regex, choice, Lark grammar)
//!   is compiled once per vocabulary and cached; every sequence that uses it
//!   starts from a deep clone of the compiled matcher.
//! * A [`GrammarState`] is one sequence's position in its grammar: it yields
//!   the set of tokens allowed next (EOS exactly when the grammar accepts) and
//!   advances by the tokens the sequence appends.
//! * [`apply_masks`] writes `-inf` into the disallowed logits of many rows at
//!   once, computing the rows' masks in parallel.
//!
//! Every llguidance call that could panic on odd input (token bytes, EOS ids)
//! is checked first or runs under `catch_unwind`, so no panic reaches Python.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use rayon::prelude::*;
use serde_json::Value;

use crate::error::{CoreError, CoreResult};

/// Compiled grammars kept per vocabulary (least recently used dropped first).
const GRAMMAR_CACHE_SIZE: usize = 256;

/// What a constrained request asks the output to be.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Constraint {
    /// A JSON value matching this JSON schema (its text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A string the regular expression matches in full.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark-style grammar (llguidance's dialect).
    Grammar(String),
}

impl Constraint {
    /// The constraint as llguidance's grammar description; JSON schema errors
    /// name the path of the offending keyword.
    fn top_level(&self, whitespace_flexible: bool) -> CoreResult<TopLevelGrammar> {
        match self {
            Constraint::JsonSchema(text) => {
                let mut schema: Value = serde_json::from_str(text)
                    .map_err(|e| CoreError::invalid(format!("json: not valid JSON: {e}")))?;
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(CoreError::invalid(
                        "json: a JSON schema must be an object or a boolean",
                    ));
                }
                set_whitespace(&mut schema, whitespace_flexible);
                Ok(TopLevelGrammar::from_json_schema(schema))
            }
            Constraint::JsonObject => {
                let mut schema = serde_json::json!({"type": "object"});
                set_whitespace(&mut schema, whitespace_flexible);
                Ok(TopLevelGrammar::from_json_schema(schema))
            }
            Constraint::Regex(rx) => {
                // Checked here so the error speaks of the regex, not of a grammar.
                regex_syntax::Parser::new()
                    .parse(rx)
                    .map_err(|e| CoreError::invalid(format!("regex: invalid: {e}")))?;
                Ok(TopLevelGrammar::from_regex(rx))
            }
            Constraint::Choice(items) => {
                if items.is_empty() {
                    return Err(CoreError::invalid("choice: needs at least one string"));
                }
                let alternatives: Vec<String> =
                    items.iter().map(|s| regex_syntax::escape(s)).collect();
                Ok(TopLevelGrammar::from_regex(&format!(
                    "(?:{})",
                    alternatives.join("|")
                )))
            }
            Constraint::Grammar(text) => {
                if text.trim().is_empty() {
                    return Err(CoreError::invalid("grammar: is empty"));
                }
                Ok(TopLevelGrammar::from_lark(text.clone()))
            }
        }
    }

    /// The request field this constraint came from, for error messages.
    fn field(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json",
            Constraint::JsonObject => "json_object",
            Constraint::Regex(_) => "regex",
            Constraint::Choice(_) => "choice",
            Constraint::Grammar(_) => "grammar",
        }
    }
}

/// Sets llguidance's whitespace option inside a schema object (its
/// `x-guidance` key), unless the caller set one there.
fn set_whitespace(schema: &mut Value, flexible: bool) {
    if let Value::Object(map) = schema {
        let opts = map
            .entry("x-guidance")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Value::Object(opts) = opts {
            opts.entry("whitespace_flexible")
                .or_insert(Value::Bool(flexible));
        }
    }
}

/// Where in `schema` the first of `keys` appears as a keyword, as a JSON
/// pointer (`#/properties/a/items`). Property names under `properties`,
/// `$defs` and `definitions` are names, not keywords, so they never match.
fn keyword_path(schema: &Value, keys: &[String], path: &mut Vec<String>) -> Option<String> {
    let Value::Object(map) = schema else {
        if let Value::Array(items) = schema {
            for (i, v) in items.iter().enumerate() {
                path.push(i.to_string());
                if let Some(p) = keyword_path(v, keys, path) {
                    return Some(p);
                }
                path.pop();
            }
        }
        return None;
    };
    if let Some(k) = map.keys().find(|k| keys.iter().any(|key| key == *k)) {
        path.push(k.clone());
        return Some(format!("#/{}", path.join("/")));
    }
    for (k, v) in map {
        path.push(k.clone());
        let found = if matches!(
            k.as_str(),
            "properties" | "$defs" | "definitions" | "patternProperties" | "dependentSchemas"
        ) {
            match v {
                Value::Object(named) => named.iter().find_map(|(name, sub)| {
                    path.push(name.clone());
                    let p = keyword_path(sub, keys, path);
                    path.pop();
                    p
                }),
                _ => None,
            }
        } else if matches!(v, Value::Object(_) | Value::Array(_))
            && !matches!(k.as_str(), "enum" | "const" | "examples" | "default")
        {
            keyword_path(v, keys, path)
        } else {
            None
        };
        if found.is_some() {
            return found;
        }
        path.pop();
    }
    None
}

/// A compile error in words a user can act on: the field, and for a JSON
/// schema's unsupported keyword, its path in the schema.
fn compile_error(constraint: &Constraint, err: &str) -> CoreError {
    let field = constraint.field();
    if let Constraint::JsonSchema(text) = constraint {
        if let Some(rest) = err.split("Unimplemented keys: ").nth(1) {
            let keys: Vec<String> = rest
                .split('"')
                .enumerate()
                .filter(|(i, _)| i % 2 == 1)
                .map(|(_, s)| s.to_string())
                .collect();
            if let Ok(schema) = serde_json::from_str::<Value>(text) {
                if let Some(path) = keyword_path(&schema, &keys, &mut Vec::new()) {
                    return CoreError::invalid(format!(
                        "json: the schema keyword at {path} is not supported by structured \
                         outputs (unsupported keys: {})",
                        keys.join(", ")
                    ));
                }
            }
        }
        return CoreError::invalid(format!("json: invalid or unsupported schema: {err}"));
    }
    CoreError::invalid(format!("{field}: {err}"))
}

/// Runs `f`, turning a panic inside the grammar engine into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> CoreResult<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".to_string());
        CoreError::Internal(format!("{what}: the grammar engine failed: {msg}"))
    })
}

/// A token environment from a `tokenizer.json`: every token's bytes and the
/// tokenizer itself (HF tokenizers), so that text the grammar forces is
/// tokenized canonically; padded with unreachable special tokens up to
/// `vocab_size` (a model's embedding may be larger than its tokenizer).
fn tokenizer_env(
    tokenizer_json: &[u8],
    eos_token_ids: &[u32],
    vocab_size: usize,
) -> CoreResult<TokEnv> {
    let json: Value = serde_json::from_slice(tokenizer_json)
        .map_err(|e| CoreError::invalid(format!("tokenizer.json: not valid JSON: {e}")))?;
    // Checked here so the trie builder never meets a malformed byte token.
    if let Some(vocab) = json["model"]["vocab"].as_object() {
        for name in vocab.keys() {
            if name.starts_with("<0x")
                && !(name.len() == 6
                    && name.ends_with('>')
                    && u8::from_str_radix(&name[3..5], 16).is_ok())
            {
                return Err(CoreError::invalid(format!(
                    "tokenizer.json: token {name:?} looks like a byte token but is not <0xHH>"
                )));
            }
        }
    }
    let mut bt = guarded("tokenizer.json", || {
        toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(tokenizer_json)
    })?
    .map_err(|e| CoreError::invalid(format!("tokenizer.json: {e}")))?;
    let n_tok = bt.tokrx_info().vocab_size as usize;
    if n_tok > vocab_size {
        return Err(CoreError::invalid(format!(
            "tokenizer.json: has {n_tok} tokens, more than the model's vocabulary of {vocab_size}"
        )));
    }
    if eos_token_ids.is_empty() {
        return Err(CoreError::invalid(
            "vocabulary: structured outputs need at least one EOS token id",
        ));
    }
    if let Some(&bad) = eos_token_ids.iter().find(|&&t| t as usize >= n_tok) {
        return Err(CoreError::invalid(format!(
            "vocabulary: EOS token id {bad} is outside the tokenizer's vocabulary [0, {n_tok})"
        )));
    }
    let text_added = text_added_tokens(&json, n_tok);
    if !text_added.is_empty() {
        // The trie builder takes every added token written `<...>` for a
        // special one, so a grammar's text `<tool_call>` could be forced as
        // that token and then refused: tokens the tokenizer declares
        // non-special (Qwen's <think>, <tool_call>, ...) are text here.
        let mut words = bt.token_bytes();
        for (id, content) in text_added {
            words[id] = content.into_bytes();
        }
        while words.len() < vocab_size {
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let info = TokRxInfo::new(vocab_size as u32, eos_token_ids[0]);
        return guarded("vocabulary", || -> TokEnv {
            let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_token_ids);
            Arc::new(ApproximateTokEnv::new(trie))
        });
    }
    bt.set_eos_tokens(eos_token_ids);
    guarded("tokenizer.json", || bt.into_tok_env(Some(vocab_size)))?
        .map_err(|e| CoreError::invalid(format!("tokenizer.json: {e}")))
}

/// The added tokens of a `tokenizer.json` that are written `<...>` but are
/// not special (`"special": false`): (id, text), ids below `n_tok`.
fn text_added_tokens(json: &Value, n_tok: usize) -> Vec<(usize, String)> {
    let Some(added) = json["added_tokens"].as_array() else {
        return Vec::new();
    };
    added
        .iter()
        .filter(|t| t["special"].as_bool() == Some(false))
        .filter_map(|t| {
            Some((
                t["id"].as_u64()? as usize,
                t["content"].as_str()?.to_string(),
            ))
        })
        .filter(|(id, c)| *id < n_tok && c.starts_with('<') && c.ends_with('>'))
        .collect()
}

/// One tokenizer's token trie and grammar compiler, with its compiled grammars.
pub struct Vocabulary {
    factory: ParserFactory,
    vocab_size: usize,
    grammars: Mutex<GrammarCache>,
}

#[derive(Default)]
struct GrammarCache {
    tick: u64,
    entries: HashMap<(Constraint, bool), (Matcher, u64)>,
}

/// The vocabularies alive in this process, by the hash of what built them
/// (weak: a vocabulary no engine holds any more is freed).
static VOCABULARIES: OnceLock<Mutex<HashMap<u64, Weak<Vocabulary>>>> = OnceLock::new();

impl Vocabulary {
    /// The vocabulary of a `tokenizer.json` for a model with `vocab_size`
    /// logits and these EOS ids: the one already alive in this process, or a
    /// new one.
    pub fn from_tokenizer_json(
        tokenizer_json: &[u8],
        eos_token_ids: &[u32],
        vocab_size: usize,
    ) -> CoreResult<Arc<Vocabulary>> {
        let mut h = DefaultHasher::new();
        tokenizer_json.hash(&mut h);
        eos_token_ids.hash(&mut h);
        vocab_size.hash(&mut h);
        let key = h.finish();
        let cache = VOCABULARIES.get_or_init(Default::default);
        if let Some(v) = cache
            .lock()
            .ok()
            .and_then(|c| c.get(&key).and_then(Weak::upgrade))
        {
            return Ok(v);
        }
        let env = tokenizer_env(tokenizer_json, eos_token_ids, vocab_size)?;
        let vocab = Arc::new(Self::from_env(env)?);
        if let Ok(mut c) = cache.lock() {
            c.retain(|_, v| v.strong_count() > 0);
            c.insert(key, Arc::downgrade(&vocab));
        }
        Ok(vocab)
    }

    /// A vocabulary from the byte string of every token (special tokens
    /// start with byte 0xFF) and the EOS ids; text the grammar forces is
    /// tokenized greedily (a non-canonical tokenizer: any tokenization is allowed).
    pub fn from_token_bytes(words: Vec<Vec<u8>>, eos_token_ids: &[u32]) -> CoreResult<Vocabulary> {
        let vocab_size = words.len();
        if vocab_size == 0 || vocab_size > u32::MAX as usize / 2 {
            return Err(CoreError::invalid(format!(
                "vocabulary: {vocab_size} tokens is not a usable size"
            )));
        }
        let Some(&first_eos) = eos_token_ids.first() else {
            return Err(CoreError::invalid(
                "vocabulary: structured outputs need at least one EOS token id",
            ));
        };
        if let Some(&bad) = eos_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(CoreError::invalid(format!(
                "vocabulary: EOS token id {bad} is outside the vocabulary [0, {vocab_size})"
            )));
        }
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let env = guarded("vocabulary", || -> TokEnv {
            let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_token_ids);
            Arc::new(ApproximateTokEnv::new(trie))
        })?;
        Self::from_env(env)
    }

    /// A vocabulary over a token environment (its trie, and its tokenizer for forced text).
    fn from_env(env: TokEnv) -> CoreResult<Vocabulary> {
        let vocab_size = env.tok_trie().vocab_size();
        let factory = guarded("vocabulary", || -> anyhow::Result<ParserFactory> {
            let mut factory = ParserFactory::new_simple(&env)?;
            factory.quiet();
            Ok(factory)
        })?
        .map_err(|e| CoreError::invalid(format!("vocabulary: {e}")))?;
        Ok(Vocabulary {
            factory,
            vocab_size,
            grammars: Mutex::new(GrammarCache::default()),
        })
    }

    /// Number of token ids (the width of every mask).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The byte string of a token (special tokens start with 0xFF).
    pub fn token_bytes(&self, token: u32) -> Vec<u8> {
        let trie = self.factory.tok_env().tok_trie();
        if (token as usize) < trie.vocab_size() {
            trie.token(token).to_vec()
        } else {
            Vec::new()
        }
    }

    /// A fresh state of `constraint`, compiling it on first use (then cached).
    pub fn start(
        &self,
        constraint: &Constraint,
        whitespace_flexible: bool,
    ) -> CoreResult<GrammarState> {
        let key = (constraint.clone(), whitespace_flexible);
        if let Ok(mut cache) = self.grammars.lock() {
            cache.tick += 1;
            let tick = cache.tick;
            if let Some((m, used)) = cache.entries.get_mut(&key) {
                *used = tick;
                let matcher = guarded(constraint.field(), || m.deep_clone())?;
                return Ok(GrammarState::new(
                    matcher,
                    self.vocab_size,
                    self.eos_tokens(),
                ));
            }
        }
        let matcher = compile(&self.factory, constraint, whitespace_flexible)?;
        if let Ok(mut cache) = self.grammars.lock() {
            if cache.entries.len() >= GRAMMAR_CACHE_SIZE {
                let oldest = cache
                    .entries
                    .iter()
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    cache.entries.remove(&k);
                }
            }
            let tick = cache.tick;
            let copy = guarded(constraint.field(), || matcher.deep_clone())?;
            cache.entries.insert(key, (copy, tick));
        }
        Ok(GrammarState::new(
            matcher,
            self.vocab_size,
            self.eos_tokens(),
        ))
    }

    fn eos_tokens(&self) -> Vec<u32> {
        self.factory.tok_env().tok_trie().eos_tokens().to_vec()
    }

    /// How many compiled grammars this vocabulary holds.
    pub fn cached_grammars(&self) -> usize {
        self.grammars.lock().map_or(0, |c| c.entries.len())
    }
}

/// Compiles `constraint` with `factory` into a started matcher.
fn compile(
    factory: &ParserFactory,
    constraint: &Constraint,
    whitespace_flexible: bool,
) -> CoreResult<Matcher> {
    let grammar = constraint.top_level(whitespace_flexible)?;
    let parser = guarded(constraint.field(), || factory.create_parser(grammar))?
        .map_err(|e| compile_error(constraint, &format!("{e:#}")))?;
    let matcher = guarded(constraint.field(), || Matcher::new(Ok(parser)))?;
    if let Some(err) = matcher.get_error() {
        return Err(compile_error(constraint, &err));
    }
    Ok(matcher)
}

/// Checks that `constraint` compiles, without a tokenizer (against a
/// one-byte-per-token vocabulary): the errors a request gets when its
/// parameters are built. Results are cached like compiled grammars.
pub fn validate(constraint: &Constraint, whitespace_flexible: bool) -> CoreResult<()> {
    static CHECKER: OnceLock<Option<Vocabulary>> = OnceLock::new();
    let checker = CHECKER.get_or_init(|| {
        let env = ApproximateTokEnv::single_byte_env();
        let trie = env.tok_trie();
        let words: Vec<Vec<u8>> = (0..trie.vocab_size() as u32)
            .map(|t| trie.token(t).to_vec())
            .collect();
        let eos = trie.eos_token();
        Vocabulary::from_token_bytes(words, &[eos]).ok()
    });
    match checker {
        Some(v) => v.start(constraint, whitespace_flexible).map(|_| ()),
        None => Err(CoreError::Internal(
            "structured outputs: the grammar checker could not be built".into(),
        )),
    }
}

/// One sequence's position in its grammar.
pub struct GrammarState {
    matcher: Matcher,
    vocab_size: usize,
    consumed: usize,
    eos: Vec<u32>,
}

impl GrammarState {
    fn new(matcher: Matcher, vocab_size: usize, eos: Vec<u32>) -> Self {
        GrammarState {
            matcher,
            vocab_size,
            consumed: 0,
            eos,
        }
    }

    /// An independent copy at the same position (a forked completion).
    pub fn fork(&self) -> CoreResult<GrammarState> {
        let matcher = guarded("fork", || self.matcher.deep_clone())?;
        Ok(GrammarState {
            matcher,
            vocab_size: self.vocab_size,
            consumed: self.consumed,
            eos: self.eos.clone(),
        })
    }

    /// Tokens consumed so far.
    pub fn num_consumed(&self) -> usize {
        self.consumed
    }

    /// The tokens allowed next: the grammar's, plus EOS exactly when it
    /// accepts; only EOS once the grammar is complete.
    pub fn mask(&mut self) -> CoreResult<SimpleVob> {
        guarded("mask", || self.matcher.compute_mask_or_eos())?
            .map_err(|e| CoreError::invalid(format!("structured output: {e}")))
    }

    /// The mask a sampling row gets: `mask()`, or, if the grammar engine
    /// failed on this sequence (its limits, an internal error), EOS alone, so
    /// that this sequence ends and the rest of the batch goes on.
    pub fn mask_or_end(&mut self) -> SimpleVob {
        match self.mask() {
            Ok(m) => m,
            Err(_) => {
                let mut m = SimpleVob::alloc(self.vocab_size);
                for &t in &self.eos {
                    if (t as usize) < self.vocab_size {
                        m.allow_token(t);
                    }
                }
                m
            }
        }
    }

    /// Advances by one appended token; an error if the grammar does not allow it.
    pub fn consume(&mut self, token: u32) -> CoreResult<()> {
        if token as usize >= self.vocab_size {
            return Err(CoreError::invalid(format!(
                "structured output: token id {token} is outside the vocabulary [0, {})",
                self.vocab_size
            )));
        }
        guarded("consume", || self.matcher.consume_token(token))?
            .map_err(|e| CoreError::invalid(format!("structured output: {e}")))?;
        self.consumed += 1;
        Ok(())
    }

    /// Steps back over the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> CoreResult<()> {
        if n > self.consumed {
            return Err(CoreError::invalid(format!(
                "structured output: cannot roll back {n} tokens, only {} consumed",
                self.consumed
            )));
        }
        guarded("rollback", || self.matcher.rollback(n))?
            .map_err(|e| CoreError::invalid(format!("structured output: {e}")))?;
        self.consumed -= n;
        Ok(())
    }

    /// Whether the text so far is a complete match (EOS would be allowed).
    pub fn is_accepting(&mut self) -> bool {
        matches!(
            guarded("is_accepting", || self.matcher.is_accepting()),
            Ok(Ok(true))
        )
    }

    /// Whether the grammar allows nothing more than EOS (complete, or failed).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The grammar engine's error, if it met one.
    pub fn error(&self) -> Option<String> {
        self.matcher.get_error()
    }
}

/// Writes `-inf` into every logit row `rows[i]` of `logits` (`[_, vocab]`)
/// whose token `states[i]` does not allow; the masks are computed in parallel.
/// A state whose grammar engine failed allows only EOS (`mask_or_end`).
/// Logit columns past the grammar's vocabulary are disallowed too.
pub fn apply_masks(
    logits: &mut [f32],
    vocab: usize,
    rows: &[usize],
    states: &mut [&mut GrammarState],
) -> CoreResult<()> {
    if rows.len() != states.len() {
        return Err(CoreError::invalid(format!(
            "rows: {} rows for {} grammar states",
            rows.len(),
            states.len()
        )));
    }
    if vocab == 0 || !logits.len().is_multiple_of(vocab) {
        return Err(CoreError::invalid(format!(
            "logits: {} values is not a whole number of rows of {vocab}",
            logits.len()
        )));
    }
    let n_rows = logits.len() / vocab;
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| rows[i]);
    for w in order.windows(2) {
        if rows[w[0]] == rows[w[1]] {
            return Err(CoreError::invalid(format!(
                "rows: row {} is listed twice",
                rows[w[0]]
            )));
        }
    }
    if let Some(&r) = rows.iter().find(|&&r| r >= n_rows) {
        return Err(CoreError::invalid(format!(
            "rows: row {r} is past the {n_rows} logit rows"
        )));
    }
    // Pair each state with its own row slice, so the rows can be masked in parallel.
    let mut slots: Vec<Option<&mut GrammarState>> = (0..n_rows).map(|_| None).collect();
    for (st, &r) in states.iter_mut().zip(rows) {
        slots[r] = Some(&mut **st);
    }
    let jobs: Vec<(&mut [f32], &mut GrammarState)> = logits
        .chunks_mut(vocab)
        .zip(slots)
        .filter_map(|(row, st)| st.map(|st| (row, st)))
        .collect();
    crate::cpu::threads::install(|| {
        jobs.into_par_iter()
            .for_each(|(row, st)| mask_row(row, &st.mask_or_end()));
    });
    Ok(())
}

/// `-inf` where `mask` has no bit (32 tokens per word, token `i` at bit `i % 32`).
fn mask_row(row: &mut [f32], mask: &SimpleVob) {
    let words = mask.as_slice();
    for (chunk, w) in row
        .chunks_mut(32)
        .zip(words.iter().copied().chain(std::iter::repeat(0)))
    {
        if w == u32::MAX {
            continue;
        }
        for (j, v) in chunk.iter_mut().enumerate() {
            if w & (1 << j) == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// The allowed set as little-endian 32-bit words (token `i` at bit `i % 32`
/// of word `i / 32`), `ceil(vocab / 32)` words: the layout a device sampler reads.
pub fn mask_words(mask: &SimpleVob, vocab: usize) -> Vec<u32> {
    let n = vocab.div_ceil(32);
    let mut out: Vec<u32> = mask.as_slice().iter().copied().take(n).collect();
    out.resize(n, 0);
    if !vocab.is_multiple_of(32) {
        if let Some(last) = out.last_mut() {
            *last &= (1u32 << (vocab % 32)) - 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of single bytes 0..=255 plus one EOS special token (id 256).
    fn byte_vocab() -> Vocabulary {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(b"\xffeos".to_vec());
        Vocabulary::from_token_bytes(words, &[256]).unwrap()
    }

    fn allowed(st: &mut GrammarState) -> Vec<u32> {
        st.mask().unwrap().to_list()
    }

    #[test]
    fn choice_allows_only_prefixes_then_eos() {
        let v = byte_vocab();
        let c = Constraint::Choice(vec!["yes".into(), "no".into()]);
        let mut st = v.start(&c, true).unwrap();
        assert_eq!(allowed(&mut st), vec![b'n' as u32, b'y' as u32]);
        st.consume(b'n' as u32).unwrap();
        assert!(!st.is_accepting());
        st.consume(b'o' as u32).unwrap();
        assert!(st.is_accepting());
        assert_eq!(allowed(&mut st), vec![256]);
        assert!(st.consume(b'x' as u32).is_err());
    }

    #[test]
    fn regex_and_rollback() {
        let v = byte_vocab();
        let mut st = v
            .start(&Constraint::Regex("a[0-9]{2}".into()), true)
            .unwrap();
        st.consume(b'a' as u32).unwrap();
        st.consume(b'1' as u32).unwrap();
        let digits: Vec<u32> = (b'0'..=b'9').map(u32::from).collect();
        assert_eq!(allowed(&mut st), digits);
        st.rollback(1).unwrap();
        assert_eq!(allowed(&mut st), digits);
        assert!(st.rollback(5).is_err());
    }

    #[test]
    fn compiled_grammars_are_cached_and_forks_independent() {
        let v = byte_vocab();
        let c = Constraint::Regex("(ab)+".into());
        let mut a = v.start(&c, true).unwrap();
        let _b = v.start(&c, true).unwrap();
        assert_eq!(v.cached_grammars(), 1);
        a.consume(b'a' as u32).unwrap();
        let mut f = a.fork().unwrap();
        f.consume(b'b' as u32).unwrap();
        assert_eq!(allowed(&mut a), vec![b'b' as u32]);
        assert!(allowed(&mut f).contains(&256));
    }

    #[test]
    fn unsupported_schema_keyword_names_its_path() {
        let schema = r#"{"type":"object","properties":{"a":{"type":"array","items":{"type":"array","uniqueItems":true}}}}"#;
        let err = validate(&Constraint::JsonSchema(schema.into()), true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("#/properties/a/items/uniqueItems"), "{err}");
        assert!(validate(
            &Constraint::JsonSchema("{\"type\":\"integer\"}".into()),
            true
        )
        .is_ok());
        assert!(validate(&Constraint::Regex("(".into()), true).is_err());
        assert!(validate(&Constraint::Grammar("start: undefined_rule".into()), true).is_err());
    }

    #[test]
    fn apply_masks_writes_neg_inf_outside_the_allowed_set() {
        let v = byte_vocab();
        let mut st = v
            .start(&Constraint::Choice(vec!["x".into()]), true)
            .unwrap();
        let vocab = 260; // wider than the grammar's 257 tokens
        let mut logits = vec![0.5f32; 2 * vocab];
        apply_masks(&mut logits, vocab, &[1], &mut [&mut st]).unwrap();
        assert!(logits[..vocab].iter().all(|&x| x == 0.5));
        let finite: Vec<usize> = (0..vocab)
            .filter(|&i| logits[vocab + i].is_finite())
            .collect();
        assert_eq!(finite, vec![b'x' as usize]);
        assert!(apply_masks(&mut logits, vocab, &[2], &mut [&mut st]).is_err());
    }

    #[test]
    fn a_failed_grammar_allows_only_eos() {
        let v = byte_vocab();
        let mut st = v.start(&Constraint::Regex("ab".into()), true).unwrap();
        assert!(st.consume(b'x' as u32).is_err()); // the matcher is now in its error state
        assert!(st.mask().is_err());
        assert_eq!(st.mask_or_end().to_list(), vec![256]);
    }

    #[test]
    fn bad_eos_and_vocab_are_errors() {
        let words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        assert!(Vocabulary::from_token_bytes(words.clone(), &[300]).is_err());
        assert!(Vocabulary::from_token_bytes(words, &[]).is_err());
    }
}
