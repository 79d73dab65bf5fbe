//! The `grammar` field: llama.cpp's GBNF translated to llguidance's Lark dialect.
//!
//! Owns: [`to_lark`]. A grammar containing `::=` is GBNF (`root ::= ...`, rule names of
//! letters, digits and dashes, `"literals"` with `\n \t \" \\ \xHH \uHHHH` escapes,
//! character classes `[...]`, `.`, groups, `|`, `* + ?`, `{m}`, `{m,}`, `{m,n}`, `#`
//! comments, rules over several lines); anything else is passed through as Lark (llama.cpp
//! users' `%llguidance {}` grammars included). Each rule becomes one Lark line: `root`
//! becomes `start`, names are lower-cased (Lark's upper-case names are terminals),
//! classes and `.` become regexes. Errors name the line and what was wrong; the
//! translated grammar is then compiled by llguidance, whose errors name the rule.

/// One GBNF token.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Define,
    /// A literal's text (escapes resolved).
    Str(String),
    /// A character class, brackets included, as a regex.
    Class(String),
    Dot,
    Open,
    Close,
    Bar,
    Op(char),
    /// `{m}`, `{m,}`, `{m,n}` as written.
    Repeat(String),
}

fn lex(src: &str) -> Result<Vec<(usize, Tok)>, String> {
    let mut out = Vec::new();
    let mut it = src.char_indices().peekable();
    let mut line = 1;
    let err = |line: usize, m: &str| Err(format!("grammar (GBNF) line {line}: {m}"));
    while let Some(&(i, c)) = it.peek() {
        match c {
            '\n' => {
                line += 1;
                it.next();
            }
            c if c.is_whitespace() => {
                it.next();
            }
            '#' => {
                while it.peek().is_some_and(|&(_, c)| c != '\n') {
                    it.next();
                }
            }
            ':' => {
                if src[i..].starts_with("::=") {
                    it.next();
                    it.next();
                    it.next();
                    out.push((line, Tok::Define));
                } else {
                    return err(line, "a `:` that is not `::=`");
                }
            }
            '"' => {
                it.next();
                let mut s = String::new();
                loop {
                    let Some((_, c)) = it.next() else {
                        return err(line, "an unclosed string");
                    };
                    match c {
                        '"' => break,
                        '\\' => s.push(escape(&mut it).ok_or_else(|| {
                            format!("grammar (GBNF) line {line}: a bad escape in a string")
                        })?),
                        '\n' => return err(line, "a newline inside a string"),
                        c => s.push(c),
                    }
                }
                out.push((line, Tok::Str(s)));
            }
            '[' => {
                it.next();
                let mut s = String::from("[");
                loop {
                    let Some((_, c)) = it.next() else {
                        return err(line, "an unclosed character class");
                    };
                    match c {
                        ']' => break,
                        '\\' => {
                            // Keep the escape for the regex, resolving GBNF-only forms.
                            let ch = escape(&mut it).ok_or_else(|| {
                                format!("grammar (GBNF) line {line}: a bad escape in a class")
                            })?;
                            s.push_str(&format!("\\x{{{:x}}}", ch as u32));
                        }
                        '/' => s.push_str("\\/"),
                        '\n' => return err(line, "a newline inside a character class"),
                        c => s.push(c),
                    }
                }
                s.push(']');
                out.push((line, Tok::Class(s)));
            }
            '{' => {
                let mut s = String::new();
                for (_, c) in it.by_ref() {
                    s.push(c);
                    if c == '}' {
                        break;
                    }
                }
                let inner = s.trim_start_matches('{').trim_end_matches('}');
                let ok = !inner.is_empty()
                    && s.ends_with('}')
                    && inner.split(',').count() <= 2
                    && inner.split(',').enumerate().all(|(k, p)| {
                        p.trim().chars().all(|c| c.is_ascii_digit())
                            && (k == 1 || !p.trim().is_empty())
                    });
                if !ok {
                    return err(line, &format!("a bad repetition `{s}`"));
                }
                out.push((
                    line,
                    Tok::Repeat(s.chars().filter(|c| !c.is_whitespace()).collect()),
                ));
            }
            '.' => {
                it.next();
                out.push((line, Tok::Dot));
            }
            '(' => {
                it.next();
                out.push((line, Tok::Open));
            }
            ')' => {
                it.next();
                out.push((line, Tok::Close));
            }
            '|' => {
                it.next();
                out.push((line, Tok::Bar));
            }
            '*' | '+' | '?' => {
                it.next();
                out.push((line, Tok::Op(c)));
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let mut s = String::new();
                while let Some(&(_, c)) = it.peek() {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        s.push(c);
                        it.next();
                    } else {
                        break;
                    }
                }
                out.push((line, Tok::Name(s)));
            }
            c => return err(line, &format!("unexpected `{c}`")),
        }
    }
    Ok(out)
}

/// The character after a backslash (`n`, `t`, `r`, `"`, `\\`, `[`, `]`, `xHH`, `uHHHH`,
/// `UHHHHHHHH`).
fn escape(it: &mut std::iter::Peekable<std::str::CharIndices<'_>>) -> Option<char> {
    let (_, c) = it.next()?;
    let hex = |it: &mut std::iter::Peekable<std::str::CharIndices<'_>>, n: usize| {
        let mut v = 0u32;
        for _ in 0..n {
            v = v * 16 + it.next()?.1.to_digit(16)?;
        }
        char::from_u32(v)
    };
    match c {
        'n' => Some('\n'),
        't' => Some('\t'),
        'r' => Some('\r'),
        'x' => hex(it, 2),
        'u' => hex(it, 4),
        'U' => hex(it, 8),
        c => Some(c),
    }
}

fn rule_name(n: &str) -> String {
    if n == "root" {
        return "start".into();
    }
    let mut s: String = n
        .chars()
        .map(|c| {
            if c == '-' {
                '_'
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect();
    if !s.starts_with(|c: char| c.is_ascii_lowercase()) || s == "start" {
        s.insert_str(0, "r_");
    }
    s
}

/// The grammar as llguidance Lark (GBNF translated; other text as is).
pub fn to_lark(grammar: &str) -> Result<String, String> {
    if !grammar.contains("::=") {
        return Ok(grammar.to_string());
    }
    let toks = lex(grammar)?;
    let mut out = String::new();
    let mut has_root = false;
    let mut i = 0;
    while i < toks.len() {
        let (line, t) = &toks[i];
        let Tok::Name(n) = t else {
            return Err(format!("grammar (GBNF) line {line}: expected a rule name"));
        };
        if toks.get(i + 1).map(|t| &t.1) != Some(&Tok::Define) {
            return Err(format!(
                "grammar (GBNF) line {line}: expected `::=` after `{n}`"
            ));
        }
        has_root |= n == "root";
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&rule_name(n));
        out.push(':');
        i += 2;
        let mut empty = true;
        while i < toks.len() {
            // A rule ends where the next `name ::=` starts.
            if matches!(toks[i].1, Tok::Name(_))
                && toks.get(i + 1).map(|t| &t.1) == Some(&Tok::Define)
            {
                break;
            }
            if !matches!(toks[i].1, Tok::Op(_) | Tok::Repeat(_)) {
                out.push(' ');
            }
            empty = false;
            match &toks[i].1 {
                Tok::Name(r) => out.push_str(&rule_name(r)),
                Tok::Str(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
                Tok::Class(c) => {
                    out.push('/');
                    out.push_str(c);
                    out.push('/');
                }
                Tok::Dot => out.push_str("/(?s:.)/"),
                Tok::Open => out.push('('),
                Tok::Close => out.push(')'),
                Tok::Bar => out.push('|'),
                Tok::Op(c) => out.push(*c),
                Tok::Repeat(r) => out.push_str(r),
                Tok::Define => {
                    return Err(format!("grammar (GBNF) line {}: a stray `::=`", toks[i].0))
                }
            }
            i += 1;
        }
        if empty {
            out.push_str(" \"\"");
        }
    }
    if !has_root {
        return Err("grammar (GBNF): no `root` rule".into());
    }
    out.push('\n');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_llama_cpp_examples() {
        // From llama.cpp's grammars/README.md (hand-translated expected Lark).
        let g = "root ::= answer\nanswer ::= \"yes\" | \"no\"  # a comment\n";
        assert_eq!(
            to_lark(g).unwrap(),
            "start: answer\nanswer: \"yes\" | \"no\"\n"
        );
        let g = "root ::= [a-z]+ ws-x{2,3}\nws-x ::= [ \\t\\n]\n  | \".\"";
        assert_eq!(
            to_lark(g).unwrap(),
            "start: /[a-z]/+ ws_x{2,3}\nws_x: /[ \\x{9}\\x{a}]/ | \".\"\n"
        );
        // Lark passes through.
        assert_eq!(to_lark("start: \"a\"").unwrap(), "start: \"a\"");
    }

    /// Translated grammars mean what the GBNF meant (checked by llguidance on bytes).
    #[test]
    fn translated_grammars_accept_what_gbnf_does() {
        use crate::constrain::{byte_level_accepts, Spec};
        let g = to_lark("root ::= \"x=\" num (\",\" num){0,2}\nnum ::= [1-9] [0-9]*  # no zero\n")
            .unwrap();
        let spec = Spec::Lark(g);
        for (text, ok) in [
            ("x=1", true),
            ("x=12,3,40", true),
            ("x=1,2,3,4", false),
            ("x=0", false),
            ("x=", false),
        ] {
            assert_eq!(byte_level_accepts(&spec, text), Ok(ok), "{text}");
        }
        let spec = Spec::Lark(to_lark("root ::= \"\\\"\" [^\"\\n]* \"\\\"\" .").unwrap());
        assert_eq!(byte_level_accepts(&spec, "\"a b\"!"), Ok(true));
        assert_eq!(byte_level_accepts(&spec, "\"a\nb\"!"), Ok(false));
    }

    #[test]
    fn errors_name_the_line() {
        for (g, want) in [
            ("root ::= \"abc", "line 1: an unclosed string"),
            (
                "root ::= x\nx ::= [a-",
                "line 2: an unclosed character class",
            ),
            ("x ::= \"a\"", "no `root` rule"),
            ("root ::= a{x}", "a bad repetition"),
            ("root ::= a ; b", "unexpected `;`"),
        ] {
            let e = to_lark(g).unwrap_err();
            assert!(e.contains(want), "{g:?}: {e}");
        }
    }
}
