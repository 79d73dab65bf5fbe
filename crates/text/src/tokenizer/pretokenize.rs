//! BPE pre-tokenizers: split text into words before merges, hand-written to follow the
//! regexes llama.cpp uses for each `tokenizer.ggml.pre` (and its custom splitters in
//! unicode.cpp), plus the GPT-2 byte-to-unicode mapping.
//!
//! Every splitter works on code points; a "segment" is a `start..end` range of code point
//! indices and each regex pass refines the segments of the previous pass (matches and the
//! gaps between them both become segments, as llama.cpp's regex split does).

use std::ops::Range;
use unicode_general_category::{get_general_category, GeneralCategory as Gc};

/// Which regex chain splits the text into words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// llama.cpp's fallback chain: punctuation runs, the GPT-2 regex, number runs, digit triples.
    Default,
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)` (gpt-2, mpt, olmo, ...).
    Gpt2,
    /// Single digits, then the GPT-2 regex (starcoder, refact, command-r, smollm, ...).
    Starcoder,
    /// The Llama 3 regex (digits in groups of up to 3).
    Llama3,
    /// The Qwen2 regex (like Llama 3, single digits).
    Qwen2,
    /// Qwen3.5: Qwen2 with combining marks (`\p{M}`) joining letter runs.
    Qwen35,
    /// Gemma 4: only runs of newlines versus the rest.
    Newlines,
    /// `joyai-llm` (DeepSeek V4; llama.cpp's DEEPSEEK3_LLM regexes), three passes as
    /// llama.cpp runs them (std::regex on category-collapsed text): `\p{N}{1,3}`, then runs
    /// of CJK / Hiragana / Katakana, then punctuation-led ASCII words, letter(+mark) runs with
    /// one optional leading other character, punctuation/symbol runs keeping trailing
    /// newlines, and the usual whitespace rules.
    JoyAi,
}

/// Unicode classes the splitters need (the categories of llama.cpp's `unicode_cpt_flags`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Flags {
    pub letter: bool,
    pub number: bool,
    pub whitespace: bool,
    pub punctuation: bool,
    pub mark: bool,
    /// Unicode symbols (Sm, Sc, Sk, So).
    pub symbol: bool,
    /// False only for positions outside the segment (llama.cpp's zero flags).
    pub any: bool,
}

pub(crate) fn flags_of(c: char) -> Flags {
    let cat = get_general_category(c);
    let letter = matches!(
        cat,
        Gc::UppercaseLetter
            | Gc::LowercaseLetter
            | Gc::TitlecaseLetter
            | Gc::ModifierLetter
            | Gc::OtherLetter
    );
    let number = matches!(cat, Gc::DecimalNumber | Gc::LetterNumber | Gc::OtherNumber);
    let punctuation = matches!(
        cat,
        Gc::ConnectorPunctuation
            | Gc::DashPunctuation
            | Gc::OpenPunctuation
            | Gc::ClosePunctuation
            | Gc::InitialPunctuation
            | Gc::FinalPunctuation
            | Gc::OtherPunctuation
    );
    let mark = matches!(
        cat,
        Gc::NonspacingMark | Gc::SpacingMark | Gc::EnclosingMark
    );
    let symbol = matches!(
        cat,
        Gc::MathSymbol | Gc::CurrencySymbol | Gc::ModifierSymbol | Gc::OtherSymbol
    );
    Flags {
        mark,
        symbol,
        letter,
        number,
        // Rust's White_Space set equals llama.cpp's unicode_set_whitespace.
        whitespace: c.is_whitespace(),
        punctuation,
        any: true,
    }
}

impl PreTokenizer {
    /// Splits `text` into words (as byte ranges into `text`), covering all of it in order.
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        let cps: Vec<char> = text.chars().collect();
        let mut byte_at = Vec::with_capacity(cps.len() + 1);
        let mut off = 0;
        for &c in &cps {
            byte_at.push(off);
            off += c.len_utf8();
        }
        byte_at.push(off);
        let whole = std::slice::from_ref(&(0..cps.len())).to_vec();
        let segs = match self {
            PreTokenizer::Default => {
                let s = split_runs(&cps, &whole, is_default_punct);
                let s = split_gpt2(&cps, &s);
                let s = split_runs(&cps, &s, is_collapsed_number);
                split_ascii_digit_triples(&cps, &s)
            }
            PreTokenizer::Gpt2 => split_gpt2(&cps, &whole),
            PreTokenizer::Starcoder => {
                let s = split_singles(&cps, &whole, is_collapsed_number);
                split_gpt2(&cps, &s)
            }
            PreTokenizer::Llama3 => split_llama3(&cps, &whole, 3, false),
            PreTokenizer::Qwen2 => split_llama3(&cps, &whole, 1, false),
            PreTokenizer::Qwen35 => split_llama3(&cps, &whole, 1, true),
            PreTokenizer::Newlines => split_newlines(&cps, &whole),
            PreTokenizer::JoyAi => {
                let s = split_number_groups(&cps, &whole, 3);
                let s = split_runs(&cps, &s, is_cjk_kana);
                split_joyai(&cps, &s)
            }
        };
        segs.into_iter()
            .filter(|r| r.start < r.end)
            .map(|r| byte_at[r.start]..byte_at[r.end])
            .collect()
    }
}

/// `[\p{P}\$\+<=>\^~\|]+` as llama.cpp's collapsed std::regex sees it.
fn is_default_punct(c: char) -> bool {
    if c.is_ascii() {
        c.is_ascii_punctuation() && c != '`'
    } else {
        let f = flags_of(c);
        !f.whitespace && f.punctuation
    }
}

/// `\p{N}` as llama.cpp's collapsed std::regex sees it (ASCII digits, or non-ASCII numbers).
fn is_collapsed_number(c: char) -> bool {
    if c.is_ascii() {
        c.is_ascii_digit()
    } else {
        let f = flags_of(c);
        !f.whitespace && f.number
    }
}

/// Splits each segment into maximal runs matching `pred` and the gaps between them.
fn split_runs(cps: &[char], segs: &[Range<usize>], pred: fn(char) -> bool) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(segs.len());
    for seg in segs {
        let mut pos = seg.start;
        while pos < seg.end {
            let start = pos;
            let m = pred(cps[pos]);
            while pos < seg.end && pred(cps[pos]) == m {
                pos += 1;
            }
            out.push(start..pos);
        }
    }
    out
}

/// Each code point matching `pred` becomes its own segment; gaps between them stay whole.
fn split_singles(cps: &[char], segs: &[Range<usize>], pred: fn(char) -> bool) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(segs.len());
    for seg in segs {
        let mut gap = seg.start;
        for pos in seg.clone() {
            if pred(cps[pos]) {
                if gap < pos {
                    out.push(gap..pos);
                }
                out.push(pos..pos + 1);
                gap = pos + 1;
            }
        }
        if gap < seg.end {
            out.push(gap..seg.end);
        }
    }
    out
}

/// `[0-9][0-9][0-9]`: leftmost non-overlapping ASCII digit triples and the gaps between.
fn split_ascii_digit_triples(cps: &[char], segs: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(segs.len());
    for seg in segs {
        let mut gap = seg.start;
        let mut pos = seg.start;
        while pos + 3 <= seg.end {
            if cps[pos..pos + 3].iter().all(char::is_ascii_digit) {
                if gap < pos {
                    out.push(gap..pos);
                }
                out.push(pos..pos + 3);
                pos += 3;
                gap = pos;
            } else {
                pos += 1;
            }
        }
        if gap < seg.end {
            out.push(gap..seg.end);
        }
    }
    out
}

/// Runs of `\n` versus runs of anything else (Gemma 4's `[^\n]+|[\n]+`).
fn split_newlines(cps: &[char], segs: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(segs.len());
    for seg in segs {
        let mut pos = seg.start;
        while pos < seg.end {
            let start = pos;
            let nl = cps[pos] == '\n';
            while pos < seg.end && (cps[pos] == '\n') == nl {
                pos += 1;
            }
            out.push(start..pos);
        }
    }
    out
}

/// Cursor over one segment: out-of-segment positions read as "no code point, no flags".
struct Seg<'a> {
    cps: &'a [char],
    start: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<Range<usize>>,
}

impl Seg<'_> {
    fn cpt(&self, pos: usize) -> Option<char> {
        (self.start <= pos && pos < self.end).then(|| self.cps[pos])
    }
    fn flags(&self, pos: usize) -> Flags {
        self.cpt(pos).map(flags_of).unwrap_or_default()
    }
    /// Ends the current word at `end`; returns its length.
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(self.prev_end..end);
        }
        self.prev_end = end;
        len
    }
    /// `'s|'t|'re|'ve|'m|'ll|'d` at `pos`, optionally ASCII case-insensitive: the match length.
    fn contraction(&self, pos: usize, case_insensitive: bool) -> usize {
        if self.cpt(pos) != Some('\'') || pos + 1 >= self.end {
            return 0;
        }
        let low = |c: Option<char>| {
            let c = c.unwrap_or('\0');
            if case_insensitive {
                c.to_ascii_lowercase()
            } else {
                c
            }
        };
        let n1 = low(self.cpt(pos + 1));
        if matches!(n1, 's' | 't' | 'm' | 'd') {
            return 2;
        }
        if pos + 2 < self.end {
            let n2 = low(self.cpt(pos + 2));
            if matches!((n1, n2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                return 3;
            }
        }
        0
    }
}

fn split_gpt2(cps: &[char], segs: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(segs.len() * 2);
    for seg in segs {
        let mut s = Seg {
            cps,
            start: seg.start,
            end: seg.end,
            prev_end: seg.start,
            out: &mut out,
        };
        let mut pos = seg.start;
        while pos < seg.end {
            let c = cps[pos];
            let flags = s.flags(pos);
            let n = s.contraction(pos, false);
            if n > 0 {
                pos += s.add(pos + n);
                continue;
            }
            let lead = usize::from(c == ' ');
            let flags2 = if c == ' ' { s.flags(pos + 1) } else { flags };
            if flags2.letter {
                pos += lead;
                while s.flags(pos).letter {
                    pos += 1;
                }
                s.add(pos);
                continue;
            }
            if flags2.number {
                pos += lead;
                while s.flags(pos).number {
                    pos += 1;
                }
                s.add(pos);
                continue;
            }
            let other = |f: Flags| !(f.whitespace || f.letter || f.number) && f.any;
            if other(flags2) {
                pos += lead;
                while other(s.flags(pos)) {
                    pos += 1;
                }
                s.add(pos);
                continue;
            }
            let mut n_ws = 0;
            while s.flags(pos + n_ws).whitespace {
                n_ws += 1;
            }
            if n_ws > 1 && s.cpt(pos + n_ws).is_some() {
                pos += n_ws - 1;
                s.add(pos);
                continue;
            }
            if n_ws > 0 {
                pos += n_ws;
                s.add(pos);
                continue;
            }
            pos += 1;
            s.add(pos);
        }
    }
    out
}

/// The Llama 3 / Qwen2 / Qwen3.5 regex; `max_digits` is 3 for Llama 3 and 1 for Qwen;
/// `marks` (Qwen3.5) lets combining marks count as letters.
fn split_llama3(
    cps: &[char],
    segs: &[Range<usize>],
    max_digits: usize,
    marks: bool,
) -> Vec<Range<usize>> {
    let lm = |f: Flags| f.letter || (marks && f.mark);
    let mut out = Vec::with_capacity(segs.len() * 2);
    for seg in segs {
        let mut s = Seg {
            cps,
            start: seg.start,
            end: seg.end,
            prev_end: seg.start,
            out: &mut out,
        };
        let mut pos = seg.start;
        while pos < seg.end {
            let c = cps[pos];
            let flags = s.flags(pos);
            let n = s.contraction(pos, true);
            if n > 0 {
                pos += s.add(pos + n);
                continue;
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(c == '\r' || c == '\n' || flags.number) && (lm(flags) || lm(s.flags(pos + 1))) {
                pos += 1;
                while lm(s.flags(pos)) {
                    pos += 1;
                }
                s.add(pos);
                continue;
            }
            // \p{N}{1,max}
            if flags.number {
                let mut ini = pos;
                while s.flags(pos).number {
                    pos += 1;
                    if pos - ini >= max_digits {
                        s.add(pos);
                        ini = pos;
                    }
                }
                s.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let other = |f: Flags| !(f.whitespace || lm(f) || f.number) && f.any;
            let flags2 = if c == ' ' { s.flags(pos + 1) } else { flags };
            if !(flags2.whitespace || lm(flags2) || flags2.number) && flags.any {
                pos += usize::from(c == ' ');
                while other(s.flags(pos)) {
                    pos += 1;
                }
                while matches!(s.cpt(pos), Some('\r' | '\n')) {
                    pos += 1;
                }
                s.add(pos);
                continue;
            }
            let mut n_ws = 0;
            let mut last_rn = None;
            while s.flags(pos + n_ws).whitespace {
                if matches!(s.cpt(pos + n_ws), Some('\r' | '\n')) {
                    last_rn = Some(pos + n_ws + 1);
                }
                n_ws += 1;
            }
            // \s*[\r\n]+
            if let Some(end) = last_rn {
                pos = end;
                s.add(pos);
                continue;
            }
            // \s+(?!\S)
            if n_ws > 1 && s.cpt(pos + n_ws).is_some() {
                pos += n_ws - 1;
                s.add(pos);
                continue;
            }
            // \s+
            if n_ws > 0 {
                pos += n_ws;
                s.add(pos);
                continue;
            }
            pos += 1;
            s.add(pos);
        }
    }
    out
}

/// `\p{N}{1,max}` (collapsed): leftmost greedy groups of up to `max` numbers, gaps kept.
fn split_number_groups(cps: &[char], segs: &[Range<usize>], max: usize) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(segs.len());
    for seg in segs {
        let mut gap = seg.start;
        let mut pos = seg.start;
        while pos < seg.end {
            if !is_collapsed_number(cps[pos]) {
                pos += 1;
                continue;
            }
            if gap < pos {
                out.push(gap..pos);
            }
            let mut n = 0;
            while pos + n < seg.end && n < max && is_collapsed_number(cps[pos + n]) {
                n += 1;
            }
            out.push(pos..pos + n);
            pos += n;
            gap = pos;
        }
        if gap < seg.end {
            out.push(gap..seg.end);
        }
    }
    out
}

/// `[一-龥぀-ゟ゠-ヿ]` (matched on the code points themselves).
fn is_cjk_kana(c: char) -> bool {
    matches!(c, '\u{4E00}'..='\u{9FA5}' | '\u{3040}'..='\u{309F}' | '\u{30A0}'..='\u{30FF}')
}

/// Character classes of the third `joyai-llm` regex as llama.cpp's collapsed std::regex
/// sees them: ASCII by its own sets, any other code point by its category (whitespace
/// first).
#[derive(Clone, Copy, Default)]
struct JoyClass {
    ws: bool,
    letter: bool,
    punct: bool,
    symbol: bool,
    mark: bool,
}

fn joy_class(c: char) -> JoyClass {
    if c.is_ascii() {
        // \s of std::regex in the C locale: space, \t, \n, \v, \f, \r.
        let ws = matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r');
        // llama.cpp's ASCII symbol set; the rest of ASCII punctuation is \p{P}.
        let symbol = matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '`' | '|' | '~');
        return JoyClass {
            ws,
            letter: c.is_ascii_alphabetic(),
            punct: c.is_ascii_punctuation() && !symbol,
            symbol,
            mark: false,
        };
    }
    let f = flags_of(c);
    if f.whitespace {
        return JoyClass {
            ws: true,
            ..JoyClass::default()
        };
    }
    JoyClass {
        ws: false,
        letter: f.letter,
        punct: f.punctuation,
        symbol: f.symbol,
        mark: f.mark,
    }
}

/// `[!-/:-@[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
/// (leftmost alternative at the leftmost position; unmatched characters stay as gaps).
fn split_joyai(cps: &[char], segs: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(segs.len() * 2);
    for seg in segs {
        let end = seg.end;
        let cls = |p: usize| {
            if p < end {
                joy_class(cps[p])
            } else {
                JoyClass::default()
            }
        };
        let lm = |p: usize| p < end && (cls(p).letter || cls(p).mark);
        let ps = |p: usize| p < end && (cls(p).punct || cls(p).symbol);
        let rn = |p: usize| p < end && matches!(cps[p], '\r' | '\n');
        let ws = |p: usize| p < end && cls(p).ws;
        let run = |mut p: usize, f: &dyn Fn(usize) -> bool| {
            while f(p) {
                p += 1;
            }
            p
        };
        let match_at = |pos: usize| -> Option<usize> {
            let c = cps[pos];
            let k = cls(pos);
            // [ASCII punctuation][A-Za-z]+
            if c.is_ascii_punctuation() && pos + 1 < end && cps[pos + 1].is_ascii_alphabetic() {
                return Some(run(pos + 1, &|p| p < end && cps[p].is_ascii_alphabetic()));
            }
            // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
            let opt = !matches!(c, '\r' | '\n') && !k.letter && !k.punct && !k.symbol;
            if opt && lm(pos + 1) {
                return Some(run(pos + 1, &lm));
            }
            if lm(pos) {
                return Some(run(pos, &lm));
            }
            //  ?[\p{P}\p{S}]+[\r\n]*
            let p0 = if c == ' ' && ps(pos + 1) {
                pos + 1
            } else {
                pos
            };
            if ps(p0) {
                let p = run(p0, &ps);
                return Some(run(p, &rn));
            }
            let n_ws = run(pos, &ws) - pos;
            if n_ws == 0 {
                return None;
            }
            // \s*[\r\n]+
            if let Some(last) = (pos..pos + n_ws).rev().find(|&p| rn(p)) {
                return Some(last + 1);
            }
            // \s+(?!\S)
            if pos + n_ws == end {
                return Some(end);
            }
            if n_ws > 1 {
                return Some(pos + n_ws - 1);
            }
            // \s+
            Some(pos + n_ws)
        };
        let mut gap = seg.start;
        let mut pos = seg.start;
        while pos < end {
            match match_at(pos) {
                Some(m) => {
                    if gap < pos {
                        out.push(gap..pos);
                    }
                    out.push(pos..m);
                    pos = m;
                    gap = m;
                }
                None => pos += 1,
            }
        }
        if gap < end {
            out.push(gap..end);
        }
    }
    out
}

/// GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to U+0100+n.
pub(crate) fn byte_to_unicode_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(p: PreTokenizer, text: &str) -> Vec<&str> {
        p.split(text).into_iter().map(|r| &text[r]).collect()
    }

    // Expected splits follow the regexes by hand (the documented pattern semantics).
    #[test]
    fn gpt2_regex() {
        assert_eq!(
            words(PreTokenizer::Gpt2, "Hello world's  end"),
            ["Hello", " world", "'s", " ", " end"]
        );
        assert_eq!(words(PreTokenizer::Gpt2, "a   "), ["a", "   "]);
        assert_eq!(words(PreTokenizer::Gpt2, "x 123!?"), ["x", " 123", "!?"]);
    }

    #[test]
    fn llama3_and_qwen2_digits() {
        assert_eq!(words(PreTokenizer::Llama3, "1234567"), ["123", "456", "7"]);
        assert_eq!(words(PreTokenizer::Qwen2, "123"), ["1", "2", "3"]);
        assert_eq!(
            words(PreTokenizer::Llama3, "I'M ok\n\n  x"),
            ["I", "'M", " ok", "\n\n", " ", " x"]
        );
        assert_eq!(words(PreTokenizer::Llama3, "(hi)\r\n"), ["(hi", ")\r\n"]);
    }

    #[test]
    fn joyai_regexes() {
        let j = |t| words(PreTokenizer::JoyAi, t);
        assert_eq!(j("12345 abc"), ["123", "45", " abc"]);
        assert_eq!(j("x;\n\ny"), ["x", ";\n\n", "y"]);
        assert_eq!(j("(hi) .Net"), ["(hi", ")", " .", "Net"]);
        assert_eq!(j("中文abc"), ["中文", "abc"]);
        assert_eq!(j("a  b"), ["a", " ", " b"]);
    }

    #[test]
    fn newlines_and_bytes() {
        assert_eq!(
            words(PreTokenizer::Newlines, "a b\n\nc"),
            ["a b", "\n\n", "c"]
        );
        let t = byte_to_unicode_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'A' as usize], 'A');
    }
}
