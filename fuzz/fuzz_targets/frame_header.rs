//! A frame header: a typed refusal, or a header within the cap that re-encodes to the same bytes.
#![no_main]

use hypershard_collectives::fuzzing::frame_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    frame_header(data);
});
