//! Tool-call ids. The parser asks its id source once per call, in call order.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

const ID_PREFIX: &str = "call_";
const ID_SUFFIX_LEN: usize = 24;
const ALPHANUMERIC: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Gives the id of each new tool call.
pub trait ToolCallIdSource {
    fn next_id(&mut self) -> String;
}

impl<S: ToolCallIdSource + ?Sized> ToolCallIdSource for &mut S {
    fn next_id(&mut self) -> String {
        (**self).next_id()
    }
}

/// Random ids `call_` + 24 alphanumeric characters, as OpenAI-style servers
/// hand out. Not cryptographic: unique enough to tell calls apart.
#[derive(Debug, Default)]
pub struct RandomToolCallIds {
    issued: u64,
}

impl ToolCallIdSource for RandomToolCallIds {
    fn next_id(&mut self) -> String {
        self.issued += 1;
        let mut id = String::with_capacity(ID_PREFIX.len() + ID_SUFFIX_LEN);
        id.push_str(ID_PREFIX);
        // Each `RandomState` is freshly keyed by the standard library.
        let mut bits = 0u64;
        for position in 0..ID_SUFFIX_LEN {
            if position % 8 == 0 {
                bits = RandomState::new().hash_one((self.issued, position));
            }
            id.push(char::from(ALPHANUMERIC[(bits % 62) as usize]));
            bits /= 62;
        }
        id
    }
}

/// Deterministic ids `call_` + a 24-digit counter starting at 0, for tests
/// and reproducible output.
#[derive(Debug, Default)]
pub struct SequentialToolCallIds {
    next: u64,
}

impl ToolCallIdSource for SequentialToolCallIds {
    fn next_id(&mut self) -> String {
        let id = format!("{ID_PREFIX}{:024}", self.next);
        self.next += 1;
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn well_formed(id: &str) -> bool {
        id.strip_prefix(ID_PREFIX).is_some_and(|suffix| {
            suffix.len() == ID_SUFFIX_LEN && suffix.bytes().all(|b| b.is_ascii_alphanumeric())
        })
    }

    #[test]
    fn random_ids_are_well_formed_and_distinct() {
        let mut ids = RandomToolCallIds::default();
        let first = ids.next_id();
        let second = ids.next_id();
        assert!(well_formed(&first), "{first}");
        assert!(well_formed(&second), "{second}");
        assert_ne!(first, second);
    }

    #[test]
    fn sequential_ids_count_up() {
        let mut ids = SequentialToolCallIds::default();
        assert_eq!(ids.next_id(), "call_000000000000000000000000");
        assert_eq!(ids.next_id(), "call_000000000000000000000001");
    }

    #[test]
    fn a_borrowed_source_advances_the_original() {
        fn first_id(mut ids: impl ToolCallIdSource) -> String {
            ids.next_id()
        }
        let mut sequential = SequentialToolCallIds::default();
        assert_eq!(first_id(&mut sequential), "call_000000000000000000000000");
        assert_eq!(sequential.next_id(), "call_000000000000000000000001");
    }
}
