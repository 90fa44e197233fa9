//! Rewriting one top-level field of a buffered request body (the engine
//! priority) without re-serialising it.

/// A rewrite of a buffered request body in the one form Envoy applies in
/// place: replace the body's first `replace` bytes with `with` (proxy-wasm's
/// body replace works on a prefix, or appends).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyEdit {
    /// Leading bytes of the body replaced.
    pub replace: usize,
    /// What replaces them.
    pub with: Vec<u8>,
}

impl BodyEdit {
    /// The body after the edit.
    pub fn apply(&self, body: &[u8]) -> Vec<u8> {
        let mut out = self.with.clone();
        out.extend_from_slice(&body[self.replace.min(body.len())..]);
        out
    }
}

/// The edit that sets the top-level member `field` of the JSON object `body`
/// to the integer `value`: every value a client gave that member (duplicates
/// and escaped spellings of the key included) is overwritten in place, else
/// the member is inserted first; members of that name inside nested objects
/// (a message's own `priority`) are left alone, and so is every other byte.
/// One pass over the body, no parse tree: it costs what the body's length
/// and the prefix up to the last overwritten value cost. `None` when `body`
/// is not one JSON object.
pub fn set_top_level_int(body: &[u8], field: &str, value: i64) -> Option<BodyEdit> {
    let mut s = Scan { b: body, i: 0 };
    s.ws();
    let open = s.i;
    s.eat(b'{')?;
    let mut hits = Vec::new();
    let mut key = Vec::new();
    let mut members = 0usize;
    s.ws();
    if s.eat(b'}').is_none() {
        loop {
            s.ws();
            key.clear();
            s.string(Some(&mut key))?;
            s.ws();
            s.eat(b':')?;
            s.ws();
            let start = s.i;
            s.value()?;
            if key == field.as_bytes() {
                hits.push((start, s.i));
            }
            members += 1;
            s.ws();
            if s.eat(b',').is_none() {
                s.eat(b'}')?;
                break;
            }
        }
    }
    s.ws();
    if s.i != body.len() {
        return None;
    }
    let number = value.to_string();
    let Some(&(_, last)) = hits.last() else {
        let mut with = body[..=open].to_vec();
        with.extend_from_slice(serde_json::to_string(field).expect("a string serialises").as_bytes());
        with.push(b':');
        with.extend_from_slice(number.as_bytes());
        if members > 0 {
            with.push(b',');
        }
        return Some(BodyEdit { replace: open + 1, with });
    };
    let mut with = Vec::with_capacity(last + hits.len() * number.len());
    let mut at = 0;
    for (start, end) in hits {
        with.extend_from_slice(&body[at..start]);
        with.extend_from_slice(number.as_bytes());
        at = end;
    }
    Some(BodyEdit { replace: last, with })
}

/// A cursor over JSON text, for [`set_top_level_int`]: it finds where values
/// start and end without building them. Every step moves forward, so a scan
/// is linear; malformed text gives `None`, never a panic.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scan<'_> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    /// Four hex digits at the cursor.
    fn hex4(&mut self) -> Option<u32> {
        let digits = self.b.get(self.i..self.i + 4)?;
        self.i += 4;
        digits.iter().try_fold(0u32, |v, &d| Some(v << 4 | (d as char).to_digit(16)?))
    }

    /// A string at the cursor, decoded into `out` when given (invalid
    /// escapes of code points become U+FFFD, which matches no field name).
    fn string(&mut self, mut out: Option<&mut Vec<u8>>) -> Option<()> {
        self.eat(b'"')?;
        loop {
            let c = *self.b.get(self.i)?;
            self.i += 1;
            match c {
                b'"' => return Some(()),
                b'\\' => {
                    let e = *self.b.get(self.i)?;
                    self.i += 1;
                    let ch = match e {
                        b'"' | b'\\' | b'/' => e as char,
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hi = self.hex4()?;
                            let code =
                                if (0xD800..0xDC00).contains(&hi) && self.b.get(self.i..self.i + 2) == Some(b"\\u") {
                                    self.i += 2;
                                    let lo = self.hex4()?;
                                    if (0xDC00..0xE000).contains(&lo) {
                                        0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
                                    } else {
                                        0xFFFD
                                    }
                                } else {
                                    hi
                                };
                            char::from_u32(code).unwrap_or('\u{FFFD}')
                        }
                        _ => return None,
                    };
                    if let Some(out) = out.as_deref_mut() {
                        out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                }
                _ => {
                    if let Some(out) = out.as_deref_mut() {
                        out.push(c);
                    }
                }
            }
        }
    }

    /// Skips one value at the cursor: a string, a scalar, or an object or
    /// array matched by bracket depth (the body was parsed as JSON before).
    fn value(&mut self) -> Option<()> {
        match *self.b.get(self.i)? {
            b'"' => self.string(None),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match *self.b.get(self.i)? {
                        b'"' => {
                            self.string(None)?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
            }
            _ => {
                let start = self.i;
                while self
                    .b
                    .get(self.i)
                    .is_some_and(|c| !matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                {
                    self.i += 1;
                }
                (self.i > start).then_some(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{parse_request, PrefixHashing};

    /// The body after setting `priority` to `v`, checked to be one JSON object.
    fn with_priority(body: &str, v: i64) -> serde_json::Value {
        let edit = set_top_level_int(body.as_bytes(), "priority", v).expect("a JSON object");
        let out = edit.apply(body.as_bytes());
        serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{}: {e}", String::from_utf8_lossy(&out)))
    }

    #[test]
    fn the_priority_field_is_inserted_or_overwritten_at_the_top_level_only() {
        let v = with_priority(r#"{"model":"m","messages":[{"role":"user","content":"hi","priority":-9}]}"#, 2);
        assert_eq!(v["priority"], 2);
        assert_eq!(v["messages"][0]["priority"], -9, "a nested key of the same name is untouched");
        assert_eq!(with_priority("{}", 1), serde_json::json!({"priority": 1}));
        assert_eq!(with_priority("  {  } \n", -3), serde_json::json!({"priority": -3}));
        // A client's own value, whatever its type, position or spelling, is overwritten.
        for client in [
            r#"{"priority":-1000,"model":"m"}"#,
            r#"{"model":"m","priority":{"nested":[1,"}"]}}"#,
            r#"{"model":"m","pri\u006frity":"urgent"}"#,
            r#"{"model":"m", "priority" : [-1], "x":{"priority":5}, "priority":-7}"#,
        ] {
            let out = set_top_level_int(client.as_bytes(), "priority", 1).unwrap().apply(client.as_bytes());
            let text = String::from_utf8(out).unwrap();
            assert!(!text.contains("-1000") && !text.contains("urgent") && !text.contains("-7"), "{text}");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!((v["priority"].clone(), v["model"].clone()), (1.into(), "m".into()), "{text}");
        }
        assert_eq!(with_priority(r#"{"model":"m", "x":{"priority":5}, "priority":-7}"#, 1)["x"]["priority"], 5);
    }

    #[test]
    fn the_priority_edit_touches_only_a_prefix() {
        let tail = "x".repeat(10_000);
        let body = format!(r#"{{"model":"m","prompt":"{tail}"}}"#);
        let edit = set_top_level_int(body.as_bytes(), "priority", 0).unwrap();
        assert_eq!((edit.replace, edit.with.as_slice()), (1, &br#"{"priority":0,"#[..]), "no client value: one byte");
        let body = format!(r#"{{"priority":9,"model":"m","prompt":"{tail}"}}"#);
        let edit = set_top_level_int(body.as_bytes(), "priority", 0).unwrap();
        assert_eq!(edit.with, br#"{"priority":0"#, "up to the client's value, not the rest");
    }

    #[test]
    fn what_is_not_one_json_object_gets_no_edit() {
        for bad in ["[1]", "\"s\"", "{\"a\":1", "{\"a\":1} x", "{\"a\"}", "{\"a\":}", "{\"a\\q\":1}", "", "{,}"] {
            assert_eq!(set_top_level_int(bad.as_bytes(), "priority", 1), None, "{bad}");
        }
        assert!(parse_request(br#"["m"]"#, PrefixHashing::OFF).unwrap_err().contains("JSON object"));
    }
}
