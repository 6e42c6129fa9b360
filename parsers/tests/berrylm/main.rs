//! Behaviour of the BerryLM parsers, after vLLM's `tests/parser/engine/test_berrylm.py`.

mod message;
mod openai_json;
mod properties;
mod reasoning;
mod streaming;
mod support;
mod tool_calls;
