#include "schedule/action.h"

#include <array>

#include "common/status.h"

namespace pipeshard {
namespace {

using R = ActionRole;
constexpr std::array<ActionKindInfo, kActionKindCount> kKinds = {{
    {ActionKind::kForward, "F", "forward", R::kCompute, false, false},
    {ActionKind::kBackward, "B", "backward", R::kCompute, true, true},
    {ActionKind::kSendActivation, "sA", "send activation", R::kSend, false, false},
    {ActionKind::kRecvActivation, "rA", "recv activation", R::kRecv, false, false},
    {ActionKind::kSendGradient, "sG", "send gradient", R::kSend, false, false},
    {ActionKind::kRecvGradient, "rG", "recv gradient", R::kRecv, false, false},
    {ActionKind::kBackwardInput, "I", "backward input", R::kCompute, true, false},
    {ActionKind::kBackwardWeight, "W", "backward weight", R::kCompute, false, true},
    {ActionKind::kReduceGradients, "R", "reduce gradients", R::kReduce, false, false},
}};

constexpr bool rows_in_order() {
  for (int i = 0; i < kActionKindCount; ++i) {
    if (static_cast<int>(kKinds[i].kind) != i) return false;
  }
  return true;
}
static_assert(rows_in_order(), "kKinds has one row per ActionKind, in enum order");
static_assert(static_cast<int>(ActionKind::kReduceGradients) + 1 == kActionKindCount,
              "kActionKindCount counts every ActionKind");

}  // namespace

const ActionKindInfo& action_kind_info(ActionKind kind) {
  const int i = static_cast<int>(kind);
  PIPESHARD_CHECK(i >= 0 && i < kActionKindCount, "action kind " + std::to_string(i));
  return kKinds[i];
}

std::string action_name(const Action& action, bool with_chunk) {
  std::string name = with_chunk ? std::to_string(action.chunk) : std::string();
  name += action_kind_info(action.kind).prefix;
  if (action.kind != ActionKind::kReduceGradients) name += std::to_string(action.micro_batch);
  return name;
}

bool splits_backward(const std::vector<Action>& actions) {
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kBackwardInput) return true;
  }
  return false;
}

}  // namespace pipeshard
