#![no_main]
//! See `sluice_filter::fuzzing::check_request_path`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| sluice_filter::fuzzing::check_request_path(data));
