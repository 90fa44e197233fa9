//! The worker's tests, one file per part, over a host shared by all ([`support`]).

mod lease;
mod role;
mod slots;
mod streams;
mod support;
