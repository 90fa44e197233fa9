//! The one table writer of the experiments: a header and rows of already formatted cells,
//! rendered as a Markdown (GitHub) table or as CSV (RFC 4180 quoting).
//!
//! Cells are strings so that each experiment keeps its own number formats (a Markdown cell
//! rounds for the reader, a CSV cell keeps the precision a script wants); the writer owns only
//! the syntax, which is where hand-written tables went wrong (unquoted commas, stray pipes).

/// How a column's cells sit in Markdown (CSV has no alignment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    /// `---`: text.
    Left,
    /// `---:`: numbers.
    Right,
}

/// A table: named columns and rows of cells.
#[derive(Clone, Debug, Default)]
pub struct Table {
    columns: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with no columns.
    pub fn new() -> Table {
        Table::default()
    }

    /// A table whose columns are `names`, all left-aligned (CSV tables, where alignment is moot).
    pub fn with_columns<S: ToString>(names: impl IntoIterator<Item = S>) -> Table {
        let mut t = Table::new();
        for n in names {
            t = t.left(n);
        }
        t
    }

    /// Adds a left-aligned column.
    pub fn left(mut self, name: impl ToString) -> Table {
        self.columns.push((name.to_string(), Align::Left));
        self
    }

    /// Adds a right-aligned column.
    pub fn right(mut self, name: impl ToString) -> Table {
        self.columns.push((name.to_string(), Align::Right));
        self
    }

    /// Appends a row. A row may be shorter than the header (a Markdown row that says why a
    /// run was skipped); the writer does not pad it, so the output is what the row holds.
    pub fn row<S: ToString>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(|c| c.to_string()).collect());
    }

    /// Rows so far.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// GitHub Markdown: `| a | b |`, a `|---|---:|` rule, one line per row. A `|` inside a
    /// cell is escaped and a line break becomes a space, since either would end the cell.
    pub fn markdown(&self) -> String {
        let mut out = md_line(self.columns.iter().map(|(n, _)| n));
        out.push('|');
        for (_, a) in &self.columns {
            out.push_str(if *a == Align::Right { "---:|" } else { "---|" });
        }
        out.push('\n');
        out + &self.markdown_rows()
    }

    /// The Markdown rows alone, for a table printed a row at a time as its runs finish.
    pub fn markdown_rows(&self) -> String {
        self.rows.iter().map(|r| md_line(r.iter())).collect()
    }

    /// CSV: the column names, then one line per row; a cell holding a comma, a quote or a line
    /// break is quoted, its quotes doubled (RFC 4180).
    pub fn csv(&self) -> String {
        let mut out = String::new();
        let mut line = |cells: &mut dyn Iterator<Item = &String>| {
            for (i, c) in cells.enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&csv_cell(c));
            }
            out.push('\n');
        };
        line(&mut self.columns.iter().map(|(n, _)| n));
        for r in &self.rows {
            line(&mut r.iter());
        }
        out
    }
}

fn md_line<'a>(cells: impl Iterator<Item = &'a String>) -> String {
    let mut s = String::from("|");
    for c in cells {
        s.push(' ');
        s.push_str(&c.replace('|', "\\|").replace(['\r', '\n'], " "));
        s.push_str(" |");
    }
    s.push('\n');
    s
}

/// One CSV field, quoted only when it must be.
pub fn csv_cell(c: &str) -> String {
    if c.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", c.replace('"', "\"\""))
    } else {
        c.to_string()
    }
}

/// An optional value as a cell: `none` when absent.
pub fn opt<T>(v: Option<T>, none: &str, f: impl FnOnce(T) -> String) -> String {
    v.map_or_else(|| none.to_string(), f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_has_header_rule_and_rows() {
        let mut t = Table::new().left("policy").right("tok/s");
        t.row(["vtc", "781"]);
        t.row(vec!["fcfs".to_string(), format!("{:.0}", 780.6)]);
        assert_eq!(t.markdown(), "| policy | tok/s |\n|---|---:|\n| vtc | 781 |\n| fcfs | 781 |\n");
        assert_eq!(t.len(), 2);
        assert_eq!(t.markdown_rows(), "| vtc | 781 |\n| fcfs | 781 |\n");
    }

    #[test]
    fn markdown_escapes_pipes_and_line_breaks_and_keeps_short_rows() {
        let mut t = Table::new().left("a").left("b").left("c");
        t.row(["x|y", "two\nlines"]);
        assert_eq!(t.markdown(), "| a | b | c |\n|---|---|---|\n| x\\|y | two lines |\n");
    }

    #[test]
    fn csv_quotes_only_fields_that_need_it() {
        let mut t = Table::with_columns(["id", "reason", "n"]);
        t.row(["1", "plain", "3"]);
        t.row(["2", "a, b", ""]);
        t.row(["3", "say \"no\"", "x"]);
        t.row(["4", "line\nbreak", "y"]);
        assert_eq!(t.csv(), "id,reason,n\n1,plain,3\n2,\"a, b\",\n3,\"say \"\"no\"\"\",x\n4,\"line\nbreak\",y\n");
    }

    #[test]
    fn csv_header_alone_when_no_rows() {
        let t = Table::with_columns(["a", "b,c"]);
        assert!(t.is_empty());
        assert_eq!(t.csv(), "a,\"b,c\"\n");
    }

    #[test]
    fn opt_renders_absent_values() {
        assert_eq!(opt(Some(1.234), "-", |v| format!("{v:.2}")), "1.23");
        assert_eq!(opt(None::<f64>, "-", |v| format!("{v:.2}")), "-");
    }
}
