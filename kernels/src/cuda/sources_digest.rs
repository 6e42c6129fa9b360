//! The digest that ties the CUDA library to the sources of this crate: the
//! build script compiles it into the library, the crate computes it from the
//! sources it was compiled with, and a launch checks that the two agree.
//! Shared by both (`build.rs` includes this file).

/// FNV-1a (64 bits) over each file's name, a zero byte and its contents, in
/// the order given.
pub fn sources_digest<'a>(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET_BASIS;
    for (name, contents) in files {
        for &byte in name.as_bytes().iter().chain([&0]).chain(contents) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(PRIME);
        }
    }
    hash
}
