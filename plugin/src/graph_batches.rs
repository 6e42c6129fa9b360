//! Which batch sizes decode steps are replayed from CUDA graphs at
//! (`crate::decode_graph`, CUDA builds only; the policy itself is plain data so
//! that command lines can name it on any build).

use std::fmt;
use std::str::FromStr;

/// The largest batch a decode graph may take.
pub const LARGEST: usize = 256;

/// A set of batch sizes (numbers of sequences, 1 to [`LARGEST`]) whose decode
/// steps are captured; a step of another size replays the next larger size's
/// graph with pad rows, and steps beyond the largest run eagerly.
#[derive(Clone, PartialEq, Eq)]
pub struct GraphBatches {
    /// `taken[b]`: batches of `b` sequences are captured.
    taken: [bool; LARGEST + 1],
}

impl GraphBatches {
    /// Every batch of up to 8 sequences, then 16, 32, 64, 128 and 256: the
    /// sizes a server's decode batches mostly have (all its sequences
    /// decoding together), each graph captured when its size first repeats.
    pub fn standard() -> GraphBatches {
        let sizes = (1..=8).chain([16, 32, 64, 128, 256]);
        GraphBatches::of(sizes).expect("the standard sizes are in range")
    }

    /// The sizes `sizes`; `None` if one is 0 or above [`LARGEST`].
    pub fn of(sizes: impl IntoIterator<Item = usize>) -> Option<GraphBatches> {
        let mut taken = [false; LARGEST + 1];
        for size in sizes {
            if !(1..=LARGEST).contains(&size) {
                return None;
            }
            taken[size] = true;
        }
        Some(GraphBatches { taken })
    }

    /// The size a decode step of `rows` sequences replays at: the smallest
    /// size of at least `rows` (the step padded to it), `None` beyond the
    /// largest.
    pub fn padded(&self, rows: usize) -> Option<usize> {
        self.sizes().find(|&size| size >= rows.max(1))
    }

    /// The sizes, in increasing order.
    pub fn sizes(&self) -> impl Iterator<Item = usize> + '_ {
        (1..=LARGEST).filter(|&size| self.taken[size])
    }
}

impl Default for GraphBatches {
    fn default() -> Self {
        GraphBatches::standard()
    }
}

impl fmt::Debug for GraphBatches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.sizes()).finish()
    }
}

/// A comma-separated list of sizes and ranges (`1-8,16,64`), or `standard`.
impl FromStr for GraphBatches {
    type Err = String;

    fn from_str(value: &str) -> Result<GraphBatches, String> {
        if value.trim() == "standard" {
            return Ok(GraphBatches::standard());
        }
        let mut sizes = Vec::new();
        for item in value
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
        {
            let bound = |text: &str| {
                text.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|size| (1..=LARGEST).contains(size))
                    .ok_or_else(|| {
                        format!("`{item}`: batch sizes are whole numbers from 1 to {LARGEST}")
                    })
            };
            match item.split_once('-') {
                Some((low, high)) => {
                    let (low, high) = (bound(low)?, bound(high)?);
                    if low > high {
                        return Err(format!("`{item}`: the range is empty"));
                    }
                    sizes.extend(low..=high);
                }
                None => sizes.push(bound(item)?),
            }
        }
        if sizes.is_empty() {
            return Err("no batch sizes given".into());
        }
        Ok(GraphBatches::of(sizes).expect("every size was checked"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_sizes_are_issue_13s_buckets_with_every_small_batch() {
        let sizes: Vec<usize> = GraphBatches::standard().sizes().collect();
        assert_eq!(sizes, [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256]);
    }

    #[test]
    fn steps_pad_to_the_next_size() {
        let standard = GraphBatches::standard();
        let padded: Vec<Option<usize>> = [1, 8, 9, 16, 17, 40, 64, 65, 200, 256, 257]
            .into_iter()
            .map(|rows| standard.padded(rows))
            .collect();
        let sizes = [1, 8, 16, 16, 32, 64, 64, 128, 256, 256];
        let mut expected: Vec<Option<usize>> = sizes.into_iter().map(Some).collect();
        expected.push(None);
        assert_eq!(padded, expected);
        let sparse: GraphBatches = "4,8".parse().unwrap();
        assert_eq!(sparse.padded(1), Some(4));
        assert_eq!(sparse.padded(9), None);
    }

    #[test]
    fn lists_and_ranges_parse() {
        let parsed: GraphBatches = "1-3, 9,200-201".parse().unwrap();
        assert_eq!(parsed.sizes().collect::<Vec<_>>(), [1, 2, 3, 9, 200, 201]);
        assert_eq!(
            "standard".parse::<GraphBatches>(),
            Ok(GraphBatches::standard())
        );
    }

    #[test]
    fn bad_lists_are_refused_by_name() {
        for (text, says) in [
            ("0", "`0`: batch sizes are whole numbers from 1 to 256"),
            ("257", "`257`: batch sizes"),
            ("4-2", "`4-2`: the range is empty"),
            ("x", "`x`: batch sizes"),
            ("", "no batch sizes given"),
        ] {
            let error = text.parse::<GraphBatches>().unwrap_err();
            assert!(error.starts_with(says), "{text:?}: {error}");
        }
    }
}
