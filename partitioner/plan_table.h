// What partition prints for a Plan: one row per stage (or chunk) with its layers,
// parameters, share, activations crossing its cut, memory estimate and nodes, then the
// balance and the memory estimate's assumptions.
#ifndef PIPESHARD_PARTITIONER_PLAN_TABLE_H_
#define PIPESHARD_PARTITIONER_PLAN_TABLE_H_

#include <cstdint>
#include <string>

#include "ir/graph.h"
#include "partitioner/plan.h"

namespace pipeshard {

// "1,234,567".
std::string with_commas(int64_t v);

// The table of `plan` (cut from `g`), lines ending in '\n'; `dir` is the folder the stage
// files were written to, which its last line names (none when `dir` is empty: nothing written).
std::string plan_table_text(const Graph& g, const Plan& plan, const std::string& dir);

}  // namespace pipeshard

#endif  // PIPESHARD_PARTITIONER_PLAN_TABLE_H_
