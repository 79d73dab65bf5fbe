//! Stop strings over streamed text: where the first one starts, and how much of the text
//! can be shown without ever showing part of one (`run --stop` and the server's `stop`
//! request field share these two functions).

/// The earliest match of any non-empty `stops` in `text[from..]` (`from` is moved back to
/// a character boundary): `(byte position in text, index into stops)`. Ties go to the
/// earlier stop in the list.
pub fn first_match(text: &str, from: usize, stops: &[String]) -> Option<(usize, usize)> {
    let from = (0..=from.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let mut best: Option<(usize, usize)> = None;
    for (k, s) in stops.iter().enumerate() {
        if s.is_empty() {
            continue;
        }
        if let Some(pos) = text[from..].find(s.as_str()) {
            let pos = from + pos;
            if best.is_none_or(|(b, _)| pos < b) {
                best = Some((pos, k));
            }
        }
    }
    best
}

/// How much of `text` (which holds no complete stop string) can be shown now: everything
/// but its longest suffix that is a proper prefix of some stop string, which may still
/// grow into one.
pub fn safe_end(text: &str, stops: &[String]) -> usize {
    let mut end = text.len();
    for s in stops {
        let max = s.len().saturating_sub(1).min(text.len());
        for k in (1..=max).rev() {
            let start = text.len() - k;
            if text.is_char_boundary(start) && s.starts_with(&text[start..]) {
                end = end.min(start);
                break;
            }
        }
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn first_match_is_the_earliest_of_all_stops() {
        let stops = v(&["\nQ", "b"]);
        assert_eq!(first_match("a\nQb", 0, &stops), Some((1, 0)));
        assert_eq!(first_match("ab\nQ", 0, &stops), Some((1, 1)));
        assert_eq!(first_match("abc", 2, &stops), None);
        assert_eq!(first_match("xyz", 0, &v(&[""])), None);
        // a start inside a multi-byte character is moved back to its boundary
        assert_eq!(first_match("é\n", 1, &v(&["é"])), Some((0, 0)));
    }

    #[test]
    fn safe_end_holds_back_a_growing_prefix_only() {
        let stops = v(&["\nQuestion"]);
        assert_eq!(safe_end("Paris", &stops), 5);
        assert_eq!(safe_end("Paris\n", &stops), 5);
        assert_eq!(safe_end("Paris\nQue", &stops), 5);
        assert_eq!(safe_end("Paris\nQux", &stops), 9);
        assert_eq!(safe_end("Paris", &v(&["\n"])), 5);
    }
}
