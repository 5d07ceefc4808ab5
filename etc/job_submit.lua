--[[
slurm-ext: normalize elastic submissions (comment whose first word is "elastic").

Slurm 22.05 cannot change a pending job's GPU type, so an elastic job must carry an
untyped GPU count; the daemon then picks the type by partition (one partition per GPU
type), or inside a partition of mixed types by node features (22.05) or by retyping the
request (Slurm 23.02.6 and later). At submit time a typed request such as
--gres=gpu:a100:4 becomes gres gpu:4, in partition a100 when the job names no partition
and there is one (else the job stays in its partition), requeue is forced on (the daemon rescales by requeueing), the job
is held for the daemon (priority 0), and the user's requested type is kept in AdminComment
("requested=a100", or "requested=any" when untyped). Only root may release or
re-prioritize a held elastic job. A heterogeneous job cannot be elastic: the daemon
chooses one Cell for one job, and would resize each component on its own. Install beside
slurm.conf with JobSubmitPlugins=lua.
]]

-- The first word is "elastic", in any case (as the daemon reads it): "elasticsearch" is not.
local function is_elastic(comment)
   if comment == nil then return false end
   local rest = string.match(string.lower(comment), "^%s*elastic(.*)$")
   return rest ~= nil and (rest == "" or string.find(rest, "^%s") ~= nil)
end

-- A GPU request's type, its count (1 when it names none) and the request without the type:
-- "gres/gpu:a100:4" -> "a100", "4", "gres/gpu:4"; "gres/gpu:a100" -> "a100", "1",
-- "gres/gpu:1"; nil when untyped ("gres/gpu:4"). Plain string slicing, no pattern built
-- from the type (a type such as a100-sxm4-80gb holds pattern characters).
local function untyped(tres)
   local first, last, gtype = string.find(tres, "gpu:(%a[%w_%-]*)")
   if first == nil then return nil end
   local count = string.match(tres, "^:(%d+)", last + 1)
   local after = last + 1 + (count and #count + 1 or 0)
   local following = string.sub(tres, after, after)
   if following ~= "" and following ~= "," and following ~= "(" then return nil end
   count = count or "1"
   return gtype, count, string.sub(tres, 1, first - 1) .. "gpu:" .. count .. string.sub(tres, after)
end

local function has_partition(part_list, name)
   for _, part in pairs(part_list) do
      if part.name == name then return true end
   end
   return false
end

-- A component of a heterogeneous job has an offset (0, 1, ...); any other job NO_VAL.
local function is_het_component(job_desc)
   local offset = job_desc.het_job_offset
   return offset ~= nil and offset ~= slurm.NO_VAL and offset < slurm.NO_VAL
end

local PER_TASK_REFUSED = "slurm-ext: give an elastic job's GPUs with --gres=gpu:N, --gpus-per-node or --gpus (not --gpus-per-task or --gpus-per-socket): the scheduler chooses the count"
local HET_REFUSED = "slurm-ext: a heterogeneous job cannot be elastic (the scheduler sizes one job as a whole); submit it as one job, or drop --comment=elastic"

function slurm_job_submit(job_desc, part_list, submit_uid)
   if not is_elastic(job_desc.comment) then
      return slurm.SUCCESS
   end
   if is_het_component(job_desc) then
      slurm.log_info("slurm-ext: uid %u submitted a heterogeneous elastic job: refused", submit_uid)
      slurm.user_msg(HET_REFUSED)
      return slurm.ERROR
   end
   -- The daemon sizes an elastic job per node or per job; GPUs per task or per socket
   -- would stay beside its count (typed, on 22.05, which cannot retype a pending job).
   for _, field in ipairs({"tres_per_task", "tres_per_socket"}) do
      local tres = job_desc[field]
      if tres ~= nil and string.find(tres, "gpu", 1, true) ~= nil then
         slurm.log_info("slurm-ext: uid %u asked GPUs of an elastic job in %s: refused", submit_uid, field)
         slurm.user_msg(PER_TASK_REFUSED)
         return slurm.ERROR
      end
   end
   local requested = "any"
   -- --gres / --gpus-per-node land in tres_per_node, --gpus in tres_per_job:
   -- "gres:gpu:a100:4" (22.05 adds the "gres:" prefix) or "gpu:a100:4".
   for _, field in ipairs({"tres_per_node", "tres_per_job"}) do
      local tres = job_desc[field]
      local gtype, count, rest = nil, nil, nil
      if tres ~= nil then
         gtype, count, rest = untyped(tres)
      end
      if gtype ~= nil then
         requested = gtype
         job_desc[field] = rest
         -- A partition the user named (a mixed one, say) is kept: the daemon steers there.
         if job_desc.partition == nil and has_partition(part_list, gtype) then
            job_desc.partition = gtype
         end
      end
   end
   job_desc.requeue = 1
   job_desc.priority = 0
   job_desc.admin_comment = "requested=" .. requested
   slurm.log_info("slurm-ext: elastic job from uid %u held for the daemon (requested=%s)",
                  submit_uid, requested)
   return slurm.SUCCESS
end

-- A held elastic job's priority is the daemon's: its owner's release, hold or priority
-- change is refused with "Access/permission denied" (Slurm shows no message of a modify
-- hook's own, so the reason goes to slurmctld's log).
-- Whether a job is elastic is set at submission, where this hook normalizes and holds it:
-- only root may change it afterwards, either way (an elastic job made plain runs outside
-- the daemon; a plain one made elastic was never normalized, held or made requeueable).
-- Nor may the owner forbid an elastic job's requeue, held or running: the daemon rescales
-- and suspends by requeueing, and Slurm ends a job with Requeue=0 on exit 86 instead.
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   if modify_uid == 0 or job_rec == nil then
      return slurm.SUCCESS
   end
   local elastic = is_elastic(job_rec.comment)
   if job_desc.comment ~= nil and is_elastic(job_desc.comment) ~= elastic then
      slurm.log_info("slurm-ext: uid %u may not make job %u %s: cancel and resubmit it",
                     modify_uid, job_rec.job_id, elastic and "a plain one" or "elastic")
      return slurm.ESLURM_ACCESS_DENIED or slurm.ERROR
   end
   if not elastic then
      return slurm.SUCCESS
   end
   if job_desc.requeue == 0 then
      slurm.log_info("slurm-ext: uid %u may not forbid the requeue of elastic job %u: the daemon rescales it by requeueing",
                     modify_uid, job_rec.job_id)
      return slurm.ESLURM_ACCESS_DENIED or slurm.ERROR
   end
   if job_rec.priority ~= 0 then
      return slurm.SUCCESS
   end
   if job_desc.priority ~= nil and job_desc.priority ~= slurm.NO_VAL then
      slurm.log_info("slurm-ext: uid %u may not change the priority of elastic job %u: the daemon holds and releases it",
                     modify_uid, job_rec.job_id)
      return slurm.ESLURM_ACCESS_DENIED or slurm.ERROR
   end
   return slurm.SUCCESS
end

slurm.log_info("slurm-ext job_submit.lua loaded")
return slurm.SUCCESS
