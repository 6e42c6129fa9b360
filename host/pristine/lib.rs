//! Never built: this manifest only names the host crates to fetch.
