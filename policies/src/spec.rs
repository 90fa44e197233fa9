//! Policy specs (filled in next).
